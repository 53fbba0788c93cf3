"""load_corpus of a prepared directory, then 5000 training batches; prints the peak RSS."""
import resource
import sys
import time

from node.config import load_config
from node.data import TrainBatches, load_corpus, load_tokenizer

cfg = load_config(None)
tok = load_tokenizer(cfg.model.tokenizer)
t = time.time()
corpus = load_corpus([sys.argv[1]], cfg.data, tok)
batches = TrainBatches(corpus.train, 0, 1, 8, 128, 0)
n = 0
for step in range(5000):
    n += int(batches.get(step).numel())
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{sys.argv[1]}: {len(corpus.train):,} train tokens; 5000 batches of 8x128 ({n:,} tokens) "
      f"in {time.time() - t:.1f} s; peak RSS {rss:.0f} MB")
