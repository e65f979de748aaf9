"""A PPO-style policy-gradient step on per-token log-probs and entropy from flce, at a sampling
temperature, without materialising the [tokens, vocab] logits in the training step.

    OMP_NUM_THREADS=1 python examples/rl_policy_gradient.py

Python 3.10 to 3.13 with flce installed (docs/install.md). OMP_NUM_THREADS=1 matters on a small shared
machine (2 to 4 cores that other jobs use): with torch's default threads train_tiny_lm.py took 160 s there
against 25 s, rl_policy_gradient.py 4 s against 3 s (docs/usage.md, "Integrations").
"""

import torch

import flce

VOCAB, HIDDEN, BATCH, RESPONSE = 1000, 64, 8, 16
TEMPERATURE, CLIP, ENTROPY_COEF = 0.7, 0.2, 1e-2


def ppo_loss(logprobs, entropy, old_logprobs, advantages, mask):
    """Clipped surrogate objective minus an entropy bonus, averaged over response tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    policy_loss = -(torch.minimum(ratio * advantages, clipped * advantages) * mask).sum() / mask.sum()
    return policy_loss - ENTROPY_COEF * (entropy * mask).sum() / mask.sum()


def main(device: str | None = None) -> dict[str, float]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    body, lm_head = body.to(device), lm_head.to(device)
    prompts = torch.randint(0, VOCAB, (BATCH, RESPONSE), device=device)

    # Rollout (in practice an inference engine): actions sampled at TEMPERATURE from a slightly
    # older policy, their log-probs, and one reward per sequence turned into advantages.
    with torch.no_grad():
        logits = lm_head(body(prompts)) + 0.3 * torch.randn(BATCH, RESPONSE, VOCAB, device=device)
        old_log_p = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        actions = torch.multinomial(old_log_p.exp().reshape(-1, VOCAB), 1).reshape(BATCH, RESPONSE)
        old_logprobs = old_log_p.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        actions[:, -3:] = -100  # padding after the end of each response: no loss, no gradient
        mask = (actions != -100).float()
        rewards = torch.randn(BATCH, device=device)
        advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).unsqueeze(1)

    # Training step: flce's per-token log-probs and entropy of softmax(logits / TEMPERATURE).
    out = flce.linear_cross_entropy(body(prompts), lm_head.weight, actions, reduction="none",
                                    temperature=TEMPERATURE, return_logprobs=True, return_entropy=True)
    loss = ppo_loss(out.logprobs, out.entropy, old_logprobs, advantages, mask)
    loss.backward()
    grads = [p.grad.clone() for p in (*body.parameters(), lm_head.weight)]

    # The same step from materialised logits, to show that loss and gradients agree.
    body.zero_grad()
    lm_head.zero_grad()
    log_p = torch.log_softmax(lm_head(body(prompts)) / TEMPERATURE, dim=-1)
    ref_logprobs = log_p.gather(-1, actions.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_p.exp() * log_p).sum(-1)
    ref_loss = ppo_loss(ref_logprobs, ref_entropy, old_logprobs, advantages, mask)
    ref_loss.backward()
    ref_grads = [p.grad for p in (*body.parameters(), lm_head.weight)]

    result = {
        "loss": loss.item(),
        "loss_error": (loss - ref_loss).abs().item(),
        "max_grad_error": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=True)),
        "grad_norm": torch.cat([g.flatten() for g in grads]).norm().item(),
    }
    print(", ".join(f"{name} {value:.3g}" for name, value in result.items()))
    return result


if __name__ == "__main__":
    main()
