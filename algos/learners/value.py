"""Value functions for the learners beyond GRPO: PPO's token-level value head, ArCHer's turn critic (GAE itself is
`algos.objectives.advantages`).

Layout as in `algos.batch`: per-token tensors have ``T - 1`` columns and column ``t`` is about token
``t + 1``. A token-level value ``values[:, t]`` is the value of the state "the context up to token t",
the state in which token ``t + 1`` is sampled, so values line up with ``logp``, ``old_logp`` and
``loss_mask``:

    logp, values = logprobs_and_values(model, value_head, ids, attn, mask)  # (n, L-1) each
    adv, returns = episode_gae(token_rewards, old_values, mask, episode_id, gamma=1.0, lam=0.95)  # algos.objectives
    loss_value = vf_coef * value_loss(values, old_values, returns, mask, clip=0.2)

PPO's critic is a separate small head (`ValueHead`, one linear layer) on the policy's last hidden state: the
backbone is shared (its value gradients flow into the policy's weights, as in CleanRL's shared-network PPO
and TRL's ``AutoModelForCausalLMWithValueHead``). ArCHer's critic (`TurnCritic`) is a set of MLP heads on
pooled features of a frozen encoder (see `algos.archer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from algos.batch import hidden_logprobs, scored_hidden
from algos.objectives.losses import masked_mean

__all__ = [
    "TurnCritic",
    "ValueHead",
    "logprobs_and_values",
    "turn_features",
    "turn_spans",
    "value_loss",
]


class ValueHead(nn.Module):
    """V(s) of every token position: one linear layer on the LM's last hidden state, zero-initialised.

    Zero weights make the first values exactly 0 (the advantage of the first batch is then the discounted
    return), and keep the head from injecting a random baseline into the first update.

    Args:
        hidden_size: Width of the LM's hidden state.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """``(..., H)`` hidden states -> ``(...)`` float32 values."""
        return self.proj(hidden).squeeze(-1).float()


def logprobs_and_values(
    model: nn.Module,
    value_head: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    context_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """Log-probs of the sampled tokens and their states' values, from one pass through the decoder.

    The LM head and the value head run at the masked positions only (`algos.batch.hidden_logprobs`, as
    `algos.batch.masked_token_logprobs`).

    Args:
        model: A Hugging Face causal LM with ``get_decoder()`` and ``get_output_embeddings()``.
        value_head: Maps ``(M, H)`` hidden states to ``(M,)`` values.
        input_ids: ``(n, L)`` right-padded ids.
        attention_mask: ``(n, L)``.
        mask: ``(n, L-1)`` bool, shifted (column t scores token t+1).
        temperature: Divides the logits.
        context_grad: False: the same values, with gradient through the sampled tokens only
            (`algos.batch.scored_hidden`).

    Returns:
        ``(logp, values)``, both ``(n, L-1)`` float32 and 0 off the mask.
    """
    hidden = scored_hidden(model, input_ids, attention_mask, mask, context_grad=context_grad)  # (M, H)
    logp, _ = hidden_logprobs(model, hidden, input_ids, mask, temperature=temperature)  # (n, L-1)
    values = torch.zeros_like(logp).masked_scatter(mask, value_head(hidden).float())  # (n, L-1)
    return logp, values


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, token mean.

    Args:
        values: ``(N, L)`` current values, differentiable.
        old_values: ``(N, L)`` values when the batch was collected.
        returns: ``(N, L)`` targets (GAE returns).
        mask: ``(N, L)``, nonzero on the tokens the loss sees.
        clip: Bound on ``|V - V_old|`` in the clipped branch; None: the plain squared error.
        num_tokens: Divisor instead of ``mask.sum()`` (see `algos.objectives.losses.masked_mean`).

    Returns:
        ``(loss, clip_fraction)``: the differentiable scalar, and the detached share of masked tokens whose
        clipped branch is the larger one.
    """
    returns, old_values = returns.detach(), old_values.detach()
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * masked_mean(unclipped, mask, num_tokens), torch.zeros(())
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask, num_tokens)
    fraction = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss, fraction


# --- ArCHer's utterance-level critic -------------------------------------------------------------------------
def turn_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` of the turns of one context: the maximal runs of sampled tokens (mask 1)."""
    spans, start = [], None
    for i, bit in enumerate(list(loss_mask) + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def turn_features(hidden: Tensor, spans: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """Pooled features of each turn's state and (state, action), from one causal pass over the context.

    A causal encoder's hidden state at position p depends on tokens 0..p only, so one pass over the whole
    context gives the features of every prefix: the state of turn k is the context before its first sampled
    token, its (state, action) the context through its last one. Each feature is [mean of the prefix's
    hidden states ; hidden state of the prefix's last token].

    Args:
        hidden: ``(L, H)`` hidden states of one context.
        spans: The turns' ``[start, end)`` token spans (`turn_spans`); start >= 1.

    Returns:
        ``(state, state_action)``: ``(K, 2H)`` each, for the K turns.
    """
    prefix_mean = hidden.float().cumsum(0) / torch.arange(1, len(hidden) + 1, device=hidden.device).unsqueeze(-1)

    def at(end: int) -> Tensor:  # features of the prefix of tokens [0, end)
        return torch.cat([prefix_mean[end - 1], hidden[end - 1].float()])

    state = torch.stack([at(start) for start, _ in spans])  # (K, 2H)
    state_action = torch.stack([at(end) for _, end in spans])  # (K, 2H)
    return state, state_action


class TurnCritic(nn.Module):
    """ArCHer's utterance-level critic heads: two Q(s, a) heads (double Q) and a V(s) head, each a 2-layer MLP.

    Args:
        feature_size: Width of a turn feature (`turn_features`: twice the encoder's hidden size).
        hidden_size: Width of each MLP.
    """

    def __init__(self, feature_size: int, hidden_size: int = 256) -> None:
        super().__init__()

        def mlp() -> nn.Module:
            return nn.Sequential(
                nn.LayerNorm(feature_size), nn.Linear(feature_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, 1)
            )

        self.q1, self.q2, self.v = mlp(), mlp(), mlp()

    def q(self, state_action: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, F)`` -> both Q estimates, ``(B,)`` each."""
        return self.q1(state_action).squeeze(-1), self.q2(state_action).squeeze(-1)

    def value(self, state: Tensor) -> Tensor:
        """``(B, F)`` -> V, ``(B,)``."""
        return self.v(state).squeeze(-1)
