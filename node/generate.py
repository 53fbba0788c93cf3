"""Sampling text from a trained model (``locoswarm generate``)."""

from __future__ import annotations


def generate_text(model, tokenizer, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int,
                  seed: int, max_seq_len: int) -> str:
    """The model's continuation of ``prompt`` (sampled with ``temperature`` and ``top_k``; greedy at
    temperature 0), stopping at the end-of-document token or after ``max_new_tokens``. The model sees at
    most its ``max_seq_len`` last tokens."""
    import torch

    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]  # an empty prompt starts a new document
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([(ids + out)[-max_seq_len:]], dtype=torch.long)
            logits = model(input_ids=window).logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token == tokenizer.eos_id:
                break
            out.append(token)
    return tokenizer.decode(out)
