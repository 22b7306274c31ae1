"""Per-token log-probs of a causal LM over padded batches, and how a batch is cut into micro-batches.

Batches are `agents.collate`'s layout: ``input_ids`` and ``attention_mask`` ``(N, T)``, right-padded, and
per-token tensors ``(N, T-1)`` *shifted*, column ``t`` scoring ``input_ids[:, t + 1]``. What this module
returns is shifted alike, so ``logp``, ``old_logp`` and ``loss_mask`` line up element by element:

    batch = collate_trajectories(trajectories, pad_token_id=tok.pad_token_id)     # agents.collate
    batch["adv"] = group_advantages(rewards, group_id)[batch["episode_id"]]       # (N,)
    for rows in micro_batches(batch["attention_mask"].sum(-1).tolist(), max_tokens=16384):
        part = trim_rows(batch, rows, device)                                     # (n, L) and (n, L-1)
        logp = token_logprobs(model, part["input_ids"], part["attention_mask"])   # (n, L-1)
        terms = policy_loss(logp, part["old_logp"], part["adv"], part["loss_mask"])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn

from agents.models import cache_argument
from agents.records import Trajectory

__all__ = [
    "answer_accuracy",
    "hidden_logprobs",
    "masked_head_matches",
    "masked_token_logprobs",
    "micro_batches",
    "scored_hidden",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "trim_rows",
]


def answer_accuracy(trajectories: Sequence[Trajectory]) -> float:
    """Share of episodes whose answer has F1 > 0 (``info["f1"]``; a missing F1 counts as 0): RED's acc."""
    if not trajectories:
        raise ValueError("no trajectories")
    return sum(float(traj.info.get("f1", 0.0)) > 0 for traj in trajectories) / len(trajectories)


def micro_batches(lengths: Sequence[int], max_tokens: int, max_padding: float = 0.05) -> list[list[int]]:
    """Split rows into micro-batches of at most `max_tokens` padded tokens (rows x longest row) whose padding is at
    most `max_padding` of their padded tokens.

    Each micro-batch runs trimmed to its longest row (`trim_rows`), so its padding is what its shorter rows
    lack; with every micro-batch under `max_padding`, so is the whole pass. Rows are taken longest first and a row
    joins the current micro-batch while both bounds hold, else it starts the next one: rows of similar length
    share a micro-batch, and a row longer than `max_tokens` gets one of its own. Lengths spread wider than
    `max_padding` give more, smaller micro-batches (`max_padding=1` groups by the token budget alone).

    Args:
        lengths: Real (unpadded) length of each row.
        max_tokens: Budget of padded tokens per micro-batch.
        max_padding: Largest share of a micro-batch's padded tokens that may be padding.

    Returns:
        Lists of row indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    padding = 0  # padding tokens of the current micro-batch
    for i in order:
        if out:
            longest, rows = lengths[out[-1][0]], len(out[-1]) + 1
            extra = longest - lengths[i]
            if rows * longest <= max_tokens and padding + extra <= max_padding * rows * longest:
                out[-1].append(i)
                padding += extra
                continue
        out.append([i])
        padding = 0
    return out


def trim_rows(batch: TensorDict, rows: Sequence[int], device: torch.device | str) -> TensorDict:
    """Rows of a padded batch trimmed to their longest real length ``L`` (per-token tensors to ``L-1``), on `device`.

    Token-aligned tensors, ``(n, T, ...)`` (ids, attention mask, TorchRL's unshifted keys of `agents.torchrl_layout`),
    keep ``L`` columns; every other per-token tensor (``loss_mask``, ``old_logp``, ...) is shifted and keeps ``L-1``.
    """
    part = batch[torch.tensor(list(rows))]
    width = part["input_ids"].shape[1]  # T
    length = int(part["attention_mask"].sum(-1).max())
    out = TensorDict({}, batch_size=[len(rows)])
    for key, value in part.items(include_nested=True, leaves_only=True):
        if value.ndim >= 2:
            value = value[:, : length if value.shape[1] == width else length - 1]
        out.set(key, value)
    return out.to(device)


def scored_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, mask: Tensor, *, context_grad: bool = True
) -> Tensor:
    """The decoder's last hidden states at the positions `mask` scores, ``(M, H)`` in the order of its True entries.

    With ``context_grad`` (the default) this is one plain causal pass. Without it, and with grad enabled, two
    passes give the same values with a narrower gradient. The first, without gradient, runs the whole batch and
    keeps every layer's keys and values. The second runs only the scored positions (the model's own turns), at
    their own positions, attending to the first pass's keys and values of every other earlier token and to each
    other's fresh ones. The gradient keeps every path through the scored tokens (their embeddings, layers and
    attention to one another, across turns) and drops the paths through the context's keys and values (prompt,
    observations): the loss then cannot change how the context is encoded, only how the model's turns read it.

    In multi-turn contexts most tokens are context (a flat demonstration: ~85 scored of ~540), and a backward
    pass costs about two forward passes, so this costs about one forward pass over the context plus a forward and
    backward over the scored tokens (half the time of a full pass on SmolLM2-135M, CPU; `benchmarks/README.md`
    also measures what it learns per step against the full gradient).

    Args:
        model: A Hugging Face causal LM with `get_decoder()` (taking a KV cache, ``position_ids`` and a
            4-D boolean attention mask, as Hugging Face decoders do).
        input_ids: ``(n, L)`` right-padded ids.
        attention_mask: ``(n, L)``.
        mask: ``(n, L-1)`` bool, shifted (column t scores token t+1).
        context_grad: Whether the gradient also flows through the context's keys and values.

    Returns:
        ``(M, H)`` with M = ``mask.sum()``.
    """
    decoder = model.get_decoder()
    if context_grad or not torch.is_grad_enabled() or not bool(mask.any()):
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return hidden[:, :-1][mask]
    from transformers import DynamicCache

    length, device = input_ids.shape[1], input_ids.device
    cache = DynamicCache()
    with torch.no_grad():  # pass 1: every token's keys and values, as one plain causal pass computes them
        decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{cache_argument(): cache})
    scored = F.pad(mask, (0, 1))  # (n, L): position t is scored when column t of the shifted mask is
    counts = scored.sum(-1)  # (n,)
    width = int(counts.max())
    valid = torch.arange(width, device=device)[None, :] < counts[:, None]  # (n, Q): scored positions, then padding
    order = torch.sort(scored.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :width]  # (n, Q)
    positions = torch.where(valid, order, 0)  # (n, Q): each scored token's own position, in order
    ids = torch.where(valid, input_ids.gather(1, positions), input_ids[:, :1])  # (n, Q)
    # what each scored token attends to: earlier unscored real tokens from pass 1 (the scored tokens' pass-1 copies
    # are masked out, so every token is seen once) and scored tokens at or before it from pass 2
    earlier = torch.arange(length, device=device)[None, None, :] < positions[:, :, None]  # (n, Q, L)
    old = earlier & (attention_mask.bool() & ~scored)[:, None, :]  # (n, Q, L)
    new = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]  # (n, Q, Q)
    new = new | (~valid[:, :, None] & torch.eye(width, dtype=torch.bool, device=device))  # padding: itself (no NaN)
    allowed = torch.cat([old, new], dim=-1)[:, None]  # (n, 1, Q, L+Q)
    hidden = decoder(
        input_ids=ids, attention_mask=allowed, position_ids=positions, use_cache=True, **{cache_argument(): cache}
    ).last_hidden_state  # (n, Q, H)
    return hidden[valid]


def masked_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    context_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` computed only where `mask` is set: the LM head runs on those positions only.

    In RL contexts most tokens are prompt and observations (mask 0); projecting only the sampled positions
    onto the vocabulary saves most of the LM head's compute and the (tokens, vocab) logit memory.

    Args:
        model: A Hugging Face causal LM with `get_decoder()` and `get_output_embeddings()` whose logits are
            the plain projection of the decoder's last hidden state (`masked_head_matches` checks it).
        input_ids: ``(n, L)`` right-padded ids.
        attention_mask: ``(n, L)``.
        mask: ``(n, L-1)`` bool, shifted (column t scores token t+1).
        temperature: Divides the logits.
        with_entropy: Also return the (detached) predictive entropy at the masked positions.
        context_grad: False: the same values, with gradient through the scored tokens only (`scored_hidden`).

    Returns:
        ``(logp, entropy)``: ``(n, L-1)`` float32, 0 off the mask; entropy likewise or None.
    """
    hidden = scored_hidden(model, input_ids, attention_mask, mask, context_grad=context_grad)  # (M, H)
    logp, logits = hidden_logprobs(model, hidden, input_ids, mask, temperature=temperature)  # (n, L-1), (M, V)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            log_probs = logits.detach().log_softmax(-1)  # (M, V)
            h = -(log_probs.exp() * log_probs).sum(-1)  # (M,)
            entropy = torch.zeros_like(logp).masked_scatter(mask, h)
    return logp, entropy


def hidden_logprobs(
    model: nn.Module, hidden: Tensor, input_ids: Tensor, mask: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-probs of the tokens `mask` scores, from their hidden states: the LM head at those positions only.

    Shared by `masked_token_logprobs` and `algos.learners.value.logprobs_and_values` (which also runs its value head on
    the same hidden states).

    Args:
        model: A Hugging Face causal LM with `get_output_embeddings()`.
        hidden: ``(M, H)`` hidden states at the scored positions (`scored_hidden`).
        input_ids: ``(n, L)`` ids.
        mask: ``(n, L-1)`` bool, shifted (column t scores token t+1); M = ``mask.sum()``.
        temperature: Divides the logits.

    Returns:
        ``(logp, logits)``: ``(n, L-1)`` float32, 0 off the mask; the ``(M, V)`` float32 logits (over the
        temperature) they came from.
    """
    logits = model.get_output_embeddings()(hidden).float()  # (M, V)
    if temperature != 1.0:
        logits = logits / temperature
    target = input_ids[:, 1:][mask]  # (M,)
    picked = -F.cross_entropy(logits, target, reduction="none")  # (M,)
    logp = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)
    return logp, logits


def masked_head_matches(model: nn.Module, vocab_size: int, device: torch.device | str) -> bool:
    """Whether `masked_token_logprobs` reproduces `token_logprobs` for `model` (no logit scaling or soft-capping
    after the LM head); where it does not, a trainer keeps the full-vocabulary path."""
    ids = torch.tensor([[1, 5, 17, 300, 42, 7, 99, 3]], device=device) % vocab_size
    attn = torch.ones_like(ids)
    mask = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool, device=device)
    try:
        with torch.no_grad():
            fast, _ = masked_token_logprobs(model, ids, attn, mask)
            full = token_logprobs(model, ids, attn)
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return bool(torch.allclose(fast, full, atol=1e-4, rtol=1e-4))


def _logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """Shared loop of `token_logprobs` and `token_logprobs_and_entropy`; entropy is zeros unless asked."""
    device = next(model.parameters()).device
    length = input_ids.shape[1]
    logp_chunks, entropy_chunks = [], []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        ids = input_ids[start : start + micro_batch_size].to(device)
        attn = attention_mask[start : start + micro_batch_size].to(device)
        used = int(attn.sum(-1).max())  # right padding: later columns are padding in every row
        logp = torch.zeros(len(ids), max(length - 1, 0), device=device)  # (n, T-1)
        entropy = torch.zeros_like(logp)  # (n, T-1)
        if used >= 2:
            logits = model(input_ids=ids[:, :used], attention_mask=attn[:, :used], use_cache=False).logits
            logits = logits[:, :-1].float() / temperature  # (n, used-1, V): row t scores token t+1
            target = ids[:, 1:used].unsqueeze(-1)  # (n, used-1, 1)
            real = attn[:, 1:used].bool()  # (n, used-1)
            scored = logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)  # (n, used-1)
            logp = F.pad(torch.where(real, scored, 0.0), (0, length - used))
            if with_entropy:
                with torch.no_grad():
                    log_probs = logits.detach().log_softmax(-1)
                    h = -(log_probs.exp() * log_probs).sum(-1)  # (n, used-1)
                    entropy = F.pad(torch.where(real, h, 0.0), (0, length - used))
        logp_chunks.append(logp)
        entropy_chunks.append(entropy)
    return torch.cat(logp_chunks), torch.cat(entropy_chunks)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    micro_batch_size: int = 8,
    temperature: float = 1.0,
) -> Tensor:
    """Log-prob of every next token under a causal LM, in micro-batches.

    Differentiable when called with grad enabled. Under ``torch.no_grad`` (old or reference log-probs)
    micro-batches bound peak memory; with grad, every micro-batch's graph lives until ``backward``, so a
    trainer short of memory calls this once per micro-batch and accumulates gradients instead.

    Args:
        model: A Hugging Face causal LM (called with ``input_ids``, ``attention_mask``; returns ``.logits``).
        input_ids: ``(N, T)`` right-padded ids.
        attention_mask: ``(N, T)``, 1 on real tokens.
        micro_batch_size: Rows per forward pass; each micro-batch is trimmed to its longest row.
        temperature: Divides the logits, to score tokens under the distribution they were sampled from.

    Returns:
        ``(N, T-1)`` float32 on the model's device: column ``t`` is ``log p(input_ids[:, t+1] |
        input_ids[:, :t+1])``; 0 where ``input_ids[:, t+1]`` is padding.
    """
    logp, _ = _logprobs(model, input_ids, attention_mask, micro_batch_size, temperature, with_entropy=False)
    return logp


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    micro_batch_size: int = 8,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` plus the entropy of the predictive distribution at every position.

    One forward pass gives both, so the SFT step gets its loss and RED's SFT entropy together.

    Args:
        model: As in `token_logprobs`.
        input_ids: ``(N, T)`` right-padded ids.
        attention_mask: ``(N, T)``, 1 on real tokens.
        micro_batch_size: Rows per forward pass.
        temperature: Divides the logits.

    Returns:
        ``(logp, entropy)``, both ``(N, T-1)`` and shifted alike: ``entropy[:, t]`` is the entropy (nats)
        of the distribution that predicts token ``t+1``, 0 on padding. The entropy is detached: a
        measurement, never a loss.
    """
    return _logprobs(model, input_ids, attention_mask, micro_batch_size, temperature, with_entropy=True)
