"""The benchmark workload: N prompts of given lengths cut from a fixed English passage, as token ids, so every
engine sees exactly the same tokens."""
from __future__ import annotations

import random

PASSAGE = (
    "The history of the city begins on a small island in the middle of a slow river, where fishermen built "
    "wooden houses and traded salt, wine and grain with the boats that passed. Over the centuries the island "
    "grew into a market town, then a walled city, and finally the capital of a large and busy country. Its "
    "streets were rebuilt many times: after floods, after fires, and after the wishes of kings who wanted wide "
    "avenues, parks and monuments. Today visitors walk along the river banks, climb the towers of old churches, "
    "visit museums full of paintings and sculptures, and sit in cafes watching people pass. Scientists study the "
    "water quality of the river, engineers maintain the bridges, and teachers bring children to learn about the "
    "people who lived here long ago. In spring the trees along the quays turn green, and in autumn the leaves "
    "fall into the water and drift slowly towards the sea. A good way to understand a place is to ask how its "
    "people solved ordinary problems: how they carried water, how they heated their homes, how they moved goods "
    "from one side of town to the other, and how they decided who would lead them. "
)


def make_prompts(tokenizer, n: int = 32, min_len: int = 22, max_len: int = 200, seed: int = 0,
                 fixed_len: int | None = None) -> list[list[int]]:
    ids = tokenizer(PASSAGE * 6, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = fixed_len or rng.randint(min_len, max_len)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts
