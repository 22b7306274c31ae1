"""Training checkpoints: everything needed to continue a run exactly, written so that a crash never tears one.

- `store`: save, verify, find and load a checkpoint (the layout of a step directory);
- `background`: a checkpoint's write on a thread beside the next steps, one at a time;
- `sharded`: the same under FSDP, each rank writing its own shards with torch.distributed.checkpoint;
- `files`: the files of a step directory, the RNG state files and the commit that renames one into place;
- `atomic`: fsyncs, whole-file writes and the classification of write faults (a full disk, a read-only file
  system) into one `atomic.CheckpointWriteError`.

What a run keeps in them, and resume, is `algos.run.checkpointing`.
"""
