"""Tree rollouts (`agents.tree`, ``--rollout tree``): branches replay their shared turns and sample the rest, the
sampler reuses what the parents' contexts left, and advantages are Tree-GRPO's
(`algos.objectives.losses.tree_advantages`).

The episodes run in the real env on the real BM25 index with a tiny random model; `SearchFirst` appends a search call
to each context's first turn, so every episode searches once and can branch there.
"""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from distributed_runs import SearchFirst

import envs  # noqa: F401  (registers the ids)
from agents.records import Completion, Generation, SamplingParams, Trajectory
from agents.samplers import HFSampler
from agents.search_agents import SearchR1Agent
from agents.tree import TreeShape, branch_points, play_trees
from algos.config import preset_config
from algos.objectives.losses import group_advantages, tree_advantages
from algos.run.cli import parse_config

PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tree_advantages_add_the_within_tree_and_within_group_terms_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    trees = torch.tensor([0, 0, 1, 1, 2, 3])  # group 1: two trees of one episode each
    # tree 0: mean 0.5, sample std 0.7071; tree 1: equal rewards, 0; group 0: mean 0.75, sample std 0.5
    # group 1: mean 1, sample std 1.4142; its one-episode trees add 0
    expected = torch.tensor([0.7071 + 0.5, -0.7071 - 1.5, 0.5, 0.5, 0.7071, -0.7071])
    torch.testing.assert_close(tree_advantages(rewards, groups, trees), expected, atol=1e-3, rtol=0)
    centred = torch.tensor([0.5 + 0.25, -0.5 - 0.75, 0.25, 0.25, 1.0, -1.0])  # scale=False: Dr. GRPO's centring
    torch.testing.assert_close(tree_advantages(rewards, groups, trees, scale=False), centred, atol=1e-6, rtol=0)
    # one tree per group: twice the group's advantage (the two terms coincide)
    torch.testing.assert_close(tree_advantages(rewards, groups, groups), 2 * group_advantages(rewards, groups))


@pytest.mark.parametrize(
    ("roots", "branches", "group_size", "rounds"),
    [(2, 1, 4, 1), (2, 1, 6, 2), (1, 3, 4, 1), (1, 1, 2, 1), (4, 2, 12, 1)],
)
def test_tree_shape_rounds(roots, branches, group_size, rounds):
    assert TreeShape(roots, branches).rounds(group_size) == rounds


@pytest.mark.parametrize(("roots", "branches", "group_size"), [(2, 1, 2), (2, 1, 5), (1, 2, 4), (0, 1, 4), (2, 0, 4)])
def test_tree_shapes_that_cannot_make_the_group_are_refused(roots, branches, group_size):
    with pytest.raises(ValueError, match="group_size|roots and branches"):
        TreeShape(roots, branches).rounds(group_size)


def test_settings_refuse_a_group_size_the_trees_cannot_make_and_parse_the_branch_turns():
    with pytest.raises(ValueError, match="--group-size \\(5\\) must be --tree-roots \\(2\\)"):
        preset_config("tiny", rollout="tree", group_size=5)
    config = parse_config(
        ["--preset", "tiny", "--rollout", "tree", "--group-size", "6", "--tree-roots", "1", "--tree-branches", "5",
         "--tree-branch-turns", "1", "2"],
        algo="grpo",
    )  # fmt: skip
    assert (config.rl.rollout, config.rl.tree_roots, config.rl.tree_branches, config.rl.tree_branch_turns) == (
        "tree",
        1,
        5,
        (1, 2),
    )


def _turn(text: str) -> Completion:
    return Completion(text, (len(text),), (-0.5,), "stop")


def test_branch_points_are_the_prefixes_through_each_allowed_search():
    turns = (_turn("<search>a</search>"), _turn("<search>b</search>"), _turn("<answer>c</answer>"))
    episode = Trajectory(0, 0, (), 0.0, {}, tuple(t.text for t in turns), turns=turns, search_ends=(1, 2))
    assert branch_points(episode) == [turns[:1], turns[:2]]
    assert branch_points(episode, (2,)) == [turns[:2]]
    assert branch_points(episode, (3,)) == []


class Recorder:
    """Wraps a sampler: records each call's prompt tokens and what the transformers sampler `hf` reused and
    prefilled for it."""

    def __init__(self, inner, hf):
        self.inner, self.hf, self.calls = inner, hf, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, params):
        reused, prefilled = self.hf.reused_tokens, self.hf.prefilled_tokens
        out = self.inner.generate(prompts, params)
        tokens = sum(len(p) for p in prompts)
        self.calls.append((len(prompts), tokens, self.hf.reused_tokens - reused, self.hf.prefilled_tokens - prefilled))
        return out


@pytest.fixture(scope="module")
def played(tiny, bm25):
    """Two questions, 4 episodes each as 2 trees of 2, by an agent whose episodes search first; and the hf sampler."""
    model, tokenizer = tiny
    hf = HFSampler(model, tokenizer, max_context=2048)
    sampler = Recorder(SearchFirst(hf), hf)
    agent = SearchR1Agent(sampler, PARAMS)
    env_list = [gym.make("RedCoda-HotpotQA-v0", split="dev", retriever=bm25, max_turns=3) for _ in range(8)]
    episodes = play_trees(agent, env_list, [5, 9], [10, 11], 4, TreeShape(2, 1), seed=3)
    return episodes, hf, sampler, agent, env_list


def test_trees_make_whole_groups_of_branches_that_replay_their_shared_turns(played):
    episodes, _, _, _, _ = played
    assert [(e.example_index, e.group_id, e.tree_id) for e in episodes] == [
        (5, 10, 20), (5, 10, 20), (5, 10, 21), (5, 10, 21), (9, 11, 22), (9, 11, 22), (9, 11, 23), (9, 11, 23)
    ]  # fmt: skip
    for root, branch in zip(episodes[::2], episodes[1::2], strict=True):
        assert root.search_ends == (1,) and root.actions[0].endswith("<search>Ed Wood</search>")
        assert branch.turns[0] == root.turns[0]  # the shared turn: the same tokens and log-probs, replayed
        (ctx_root,), (ctx_branch,) = root.generations, branch.generations
        shared = len(ctx_root.token_ids) - len(_tail(ctx_root))  # prompt, first turn, its search results
        assert ctx_branch.token_ids[:shared] == ctx_root.token_ids[:shared]
        assert ctx_branch.loss_mask[:shared] == ctx_root.loss_mask[:shared]
        assert ctx_branch.sample_logprobs[:shared] == ctx_root.sample_logprobs[:shared]
        assert branch.info["num_searches"] == 1 and len(branch.actions) == 3
    assert any(b.actions[1:] != r.actions[1:] for r, b in zip(episodes[::2], episodes[1::2], strict=True))


def _tail(generation: Generation) -> tuple[int, ...]:
    """The tokens after the first search's results: from the second sampled turn on."""
    mask = generation.loss_mask
    first = mask.index(1)
    after_first = first + mask[first:].index(0)  # the first turn ends, the results begin
    second = after_first + mask[after_first:].index(1)
    return generation.token_ids[second:]


def test_branches_sample_only_their_own_turns_and_reuse_the_parents_prefill(played):
    episodes, hf, sampler, _, _ = played
    # every turn of the roots, and of the branches only the turns after their replayed one
    assert sum(rows for rows, *_ in sampler.calls) == sum(len(e.turns) for e in episodes) - len(episodes) // 2
    assert [rows for rows, *_ in sampler.calls] == [4, 4, 4, 4, 4]  # roots: 3 turns; branches: turns 2 and 3
    rows, tokens, reused, prefilled = sampler.calls[3]  # the branches' first sampled turn: the parents' contexts
    assert reused >= tokens - rows  # all but each row's last prompt token came from what the parents kept
    assert prefilled <= rows
    assert hf.cached_tokens == 0  # what was kept for the branches is released at the end


def test_tree_rollouts_repeat_from_the_seed(played, tiny, bm25):
    episodes, _, _, _, env_list = played
    model, tokenizer = tiny
    agent = SearchR1Agent(SearchFirst(HFSampler(model, tokenizer, max_context=2048)), PARAMS)
    again = play_trees(agent, env_list, [5, 9], [10, 11], 4, TreeShape(2, 1), seed=3)
    assert [e.actions for e in again] == [e.actions for e in episodes]


def test_too_few_envs_for_a_round_are_refused(played):
    _, _, _, agent, env_list = played
    with pytest.raises(ValueError, match="3 envs for 2 questions of TreeShape"):
        play_trees(agent, env_list[:3], [5, 9], [10, 11], 4, TreeShape(2, 1), seed=3)


def test_a_tree_without_a_search_branches_from_the_start(tiny, bm25):
    model, tokenizer = tiny
    agent = SearchR1Agent(HFSampler(model, tokenizer, max_context=2048), PARAMS)  # a random model never searches
    env_list = [gym.make("RedCoda-HotpotQA-v0", split="dev", retriever=bm25, max_turns=2) for _ in range(2)]
    episodes = play_trees(agent, env_list, [4], [0], 3, TreeShape(1, 2), seed=0)
    assert len(episodes) == 3 and {e.tree_id for e in episodes} == {0}
    assert all(e.search_ends == () for e in episodes)
    assert len({e.turns[0].token_ids for e in episodes}) == 3  # three fresh first turns, no replay


def test_the_trainer_gives_tree_episodes_tree_advantages(tmp_path):
    from algos.run.training_run import TrainingRun

    run = TrainingRun(preset_config("tiny", algo="grpo", run_dir=str(tmp_path), rollout="tree", group_size=4))
    try:
        gen = Generation((1, 2, 3), (0, 1, 1), (0.0, -0.3, -0.2), "agent")
        rewards, trees = [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]
        episodes = [Trajectory(0, 0, (gen,), r, {}, tree_id=t) for r, t in zip(rewards, trees, strict=True)]
        batch, _ = run.learner.make_batch(episodes)
        expected = tree_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long), torch.tensor(trees))
        torch.testing.assert_close(batch["adv"], expected)
        assert not torch.allclose(expected, group_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long)))
    finally:
        run.close()


@pytest.mark.parametrize("branch_turns", [(), (2,)], ids=["any-search", "second-search"])
def test_coda_trees_branch_after_an_executor_search_and_keep_the_contexts_apart(tiny, bm25, branch_turns):
    from test_agents import RecordingSampler, check_coda_contexts, coda_script

    from agents.search_agents import CodaAgent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), script=coda_script(1, tasks=2))
    env_list = [
        gym.make("RedCoda-HotpotQA-CoDA-v0", split="dev", retriever=bm25, max_executor_turns=2, max_planner_turns=4)
        for _ in range(6)
    ]
    episodes = play_trees(CodaAgent(sampler, PARAMS), env_list, [0, 1], [0, 1], 4, TreeShape(1, 3, branch_turns), 7)
    assert [(e.group_id, e.tree_id) for e in episodes] == [(0, 0)] * 4 + [(1, 1)] * 4
    replayed = 0
    for tree in (episodes[:4], episodes[4:]):
        root = tree[0]
        assert len(root.actions) == 7 and root.search_ends == (2, 5)  # task, search, answer, task, search, answer
        for branch in tree[1:]:
            shared = next(n for n in range(len(root.turns)) if branch.turns[n] != root.turns[n])
            assert shared in ((2, 5) if not branch_turns else (5,))  # replayed through an allowed search
            replayed += shared
            assert branch.info["answered"] and branch.info["num_tasks"] == 2
            check_coda_contexts(branch, tokenizer)  # executors fresh, no search results in the planner
            # the executor that was open at the branch point starts as the root's did, through its search results
            first = 0 if shared == 2 else 1
            a, b = root.generations[first], branch.generations[first]
            assert a.role == b.role == "executor"
            head = a.loss_mask.index(0, a.loss_mask.index(1))  # its search call ends, the results begin
            assert b.token_ids[:head] == a.token_ids[:head]
    assert sum(len(c) for _, c in sampler.calls) == sum(len(e.turns) for e in episodes) - replayed
