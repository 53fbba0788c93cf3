"""x1: 4 files of 25 MB of random-word paragraphs; x4: four copies of them (16 files). Seeded."""
import os
import random
import shutil
import sys

random.seed(0)
root = sys.argv[1]
words = ["".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(2, 9))) for _ in range(5000)]
os.makedirs(f"{root}/x1", exist_ok=True)
os.makedirs(f"{root}/x4", exist_ok=True)
for i in range(4):
    with open(f"{root}/x1/doc{i}.txt", "w") as f:
        n = 0
        while n < 25_000_000:
            para = " ".join(random.choice(words) for _ in range(200)) + ".\n\n"
            f.write(para)
            n += len(para)
for k in range(4):
    for i in range(4):
        shutil.copy(f"{root}/x1/doc{i}.txt", f"{root}/x4/doc{k}{i}.txt")
