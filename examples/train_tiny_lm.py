"""Train a tiny language model with flce: the LM head's [tokens, vocab] logits are never stored.

    OMP_NUM_THREADS=1 python examples/train_tiny_lm.py

Python 3.10 to 3.13 with flce installed (docs/install.md). OMP_NUM_THREADS=1 matters on a small shared
machine (2 to 4 cores that other jobs use): with torch's default threads train_tiny_lm.py took 160 s there
against 25 s, rl_policy_gradient.py 4 s against 3 s (docs/usage.md, "Integrations").
"""

import torch

import flce

VOCAB, HIDDEN, SEQ, BATCH = 512, 64, 24, 16


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        layer = torch.nn.TransformerEncoderLayer(HIDDEN, 4, 4 * HIDDEN, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, num_layers=2)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, seq, HIDDEN]: the loss applies lm_head itself."""
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.body(self.embed(tokens), mask=mask, is_causal=True)


def counting_batch(generator: torch.Generator) -> torch.Tensor:
    """Sequences that count up from a random start by a random stride: learnable from context."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    stride = torch.randint(1, 4, (BATCH, 1), generator=generator)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def main(steps: int = 300, device: str | None = None) -> list[float]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = TinyLM().to(device)
    loss_fn = flce.get_impl(device)(ignore_index=-100)  # a torch.nn.Module; reduction="mean"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = counting_batch(generator).to(device)
        hidden = model(tokens[:, :-1])
        loss = loss_fn(hidden, model.lm_head.weight, tokens[:, 1:])  # next-token targets
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
