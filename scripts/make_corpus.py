"""Regenerate the built-in corpus, src/parallelisms/data/corpus.txt: deterministic sentences from a small
grammar about training on many machines, so that a byte-level model has structure to learn."""

import random
from pathlib import Path

SUBJECTS = ["the worker", "each rank", "the pipeline stage", "the optimizer", "every replica", "the router",
            "the scheduler", "a slow straggler", "the first stage", "the last stage", "the expert", "the ring"]
VERBS = ["sends", "receives", "gathers", "scatters", "reduces", "computes", "waits for", "stores", "shards",
         "updates", "overlaps", "hides", "replicates", "averages", "splits"]
OBJECTS = ["the gradients", "its activations", "the parameter shards", "a bucket of gradients",
           "the attention heads", "the optimizer state", "the next microbatch", "the key and value blocks",
           "the partial sums", "the token embeddings", "the expert outputs", "the weight versions"]
TAILS = ["before the step ends", "while backward continues", "after the forward pass", "across the ring",
         "within the node", "to hide the latency", "so the bubble shrinks", "without extra memory",
         "in fixed order", "once per layer", "for every block", "on the critical path"]
OPENERS = ["then", "meanwhile", "later", "first", "finally", "so", "because the link is slow,", "in practice,"]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.7:
        words.append(rng.choice(TAILS))
    if rng.random() < 0.3:
        words.insert(0, rng.choice(OPENERS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def corpus(paragraphs: int = 1200, seed: int = 2026) -> str:
    rng = random.Random(seed)
    return "\n\n".join(" ".join(sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(paragraphs)) + "\n"


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "src" / "parallelisms" / "data" / "corpus.txt"
    out.write_text(corpus())
    print(f"wrote {out} ({out.stat().st_size} bytes)")
