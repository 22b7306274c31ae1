"""The run around an algorithm: from the command line to the final model and its held-out score.

- `cli` parses the command line into a `algos.config.Config`; `launch` is every entry point's `main` (exit
  statuses, one-line faults, signals);
- `training_run.TrainingRun` is the run: setup (`setup`), the steps, metrics and wandb; it holds the algorithm's
  learner (`learner.Learner`, the seam it calls; `learner.RunParts`, what of the run a learner may use) and its bases
  keep checkpoints and resume (`checkpointing`) and finish the run (`finish`, `outputs`);
- `control` watches the run from outside the step (signals, the training-time budget, the run directory's owner,
  torch threads: `threads`), `memory` refuses a run that cannot fit before it starts, `logs` sets up logging;
- `evaluation` scores the model before and after training (its first-search split, reading against searching, is
  `envs.first_search`'s code, which needs no torch).

The algorithms themselves (the learners, `algos.learners.trainer.Trainer` and those built on it) and the pieces they
swap (`algos.objectives`) stay one level up; the files a checkpoint is made of are `algos.checkpoints`.
"""
