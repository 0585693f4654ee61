"""Rounding spread behind eval's near-tie tolerance: how far (in ulps of the top logit) the one-token
decoding argmax lies from the top of the same position's logits computed by a full forward and by
16-token blocks, over greedy continuations of a few prompts.

    PYTHONPATH=. python bench/eval_ties.py default bfloat16 16 2   # target, dtype, new tokens, prompts
"""

import sys

import torch

from dflash_offline.eval.exactness import ulp
from dflash_offline.target_model.loader import load_target
from tests.oracles.reference_decode import TargetCaller  # transformers' forward on a DynamicCache

torch.set_num_threads(2)
spec = sys.argv[1] if len(sys.argv) > 1 else "default"
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
t = load_target(spec, device="cpu", dtype=dtype)
tok = t.tokenizer
m = t.model
caller = TargetCaller(m)
texts = [
    "Write a short poem about the sea.",
    "Explain how a hash map works, with an example in Python.",
    "What are three good reasons to learn a second language?",
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n',
]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 32
ratios_full: list[float] = []
ratios_block: list[float] = []
with torch.inference_mode():
    for text in texts[: int(sys.argv[4]) if len(sys.argv) > 4 else 4]:
        ids = tok(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        cache = caller.new_cache()
        lg = caller(ids, cache, last_only=True)[-1].float()
        inc = [lg]
        seq = list(ids)
        for _ in range(N - 1):
            seq.append(int(inc[-1].argmax()))
            inc.append(caller([seq[-1]], cache)[-1].float())
        seq.append(int(inc[-1].argmax()))
        full = m(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
        # blocks of 16 over the generated part on a fresh cache
        cache = caller.new_cache()
        caller(ids[:-1], cache)
        P = len(ids)
        blocks = []
        pos = P - 1
        while pos < len(seq) - 1:
            blk = seq[pos : pos + 16]
            blocks.append(caller(blk, cache).float())
            pos += len(blk)
        block = torch.cat(blocks)[:N]
        for i in range(N):
            a = inc[i]
            r = int(a.argmax())
            for other, out in ((full[P - 1 + i], ratios_full), (block[i], ratios_block)):
                top = float(other.max())
                g = top - float(other[r])
                out.append(g / ulp(top, dtype))

for name, r in (("full", ratios_full), ("block16", ratios_block)):
    nz = sorted(x for x in r if x > 0)
    print(
        f"{spec} {dtype}: vs {name}: {len(r)} positions, argmax differs at {len(nz)}; gap of the "
        f"one-token argmax in ulps: max {max(r):.2f}, largest {[round(x, 2) for x in nz[-8:]]}"
    )
