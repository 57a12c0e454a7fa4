"""Prompt-lookup speculative decoding on the default model, one user at a time: decode tok/s
with and without `--speculative ngram`, the acceptance rate, and whether the greedy text is
identical, per prompt.

Input-grounded prompts (the answer copies from the prompt: rewrite a function with one name
changed, answer by quoting a passage, fix a typo in a paragraph, continue a JSON list) are
where proposals are kept; free-generation prompts (nothing to look up) show what speculation
costs where it cannot help: their ratio should stay >= 0.95, as the adaptive sizing turns
proposals off once they keep failing. Figures are meaningless while other work shares the
cores; the kept/proposed counts (over all repetitions) say what the planner did.

    .venv/bin/python bench/spec_decode.py [-n 128] [-t 2] [-k 4] [-r 2] [--prompts N]
        [--draft-model PATH | --draft-pair DIR] [--fixed-k]

--draft-pair DIR measures bench/draft_pair.py's pair instead of the default model: its target
alone against the target with `--speculative draft` and its layer-skip draft, on the same
prompts (the speed-up and the draft's acceptance rate). --fixed-k proposes -k tokens every
step instead of sizing proposals from acceptance and measured step costs (which may decline
to propose while a draft costs more than it is expected to save). --prompts N takes the first
N prompts of each list (a quick check).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from draft_pair import pair_paths  # the sibling script's, by path

from kvlab.engine import EngineConfig
from kvlab.llm import LLM
from kvlab.request import SamplingParams

FUNCTIONS = [
    ("parse_header", "split_header", '''def parse_header(line):
    """Split an HTTP header line into a lower-case name and its value."""
    name, sep, value = line.partition(":")
    if not sep:
        raise ValueError(f"not a header line: {line!r}")
    return name.strip().lower(), value.strip()
'''),
    ("moving_average", "rolling_mean", '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        result.append(total / min(i + 1, window))
    return result
'''),
    ("load_config", "read_settings", '''def load_config(path, defaults=None):
    config = dict(defaults or {})
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config
'''),
]

PASSAGES = [
    ("What does the passage say the river did in the spring of 1887?",
     ("The town of Millbrook grew up along the banks of the Serle river. In the spring of "
      "1887 the river rose above its banks for eleven days and carried away the old wooden "
      "bridge, the mill and most of the houses on the lower street. The town rebuilt the "
      "bridge in stone two years later, and the mill was never rebuilt.")),
    ("According to the text, why do octopuses change colour?",
     ("Octopuses change colour using thousands of cells in their skin called chromatophores. "
      "They change colour to hide from predators, to sneak up on prey, and to signal to other "
      "octopuses. Some species can also change the texture of their skin to match rocks and "
      "coral.")),
    ("What does the manual say to do before replacing the filter?",
     ("Before replacing the filter, switch the unit off at the wall and wait for the fan to "
      "stop completely. Open the front panel by pressing the two catches on either side. Pull "
      "the old filter straight out and slide the new filter in with the arrow pointing up.")),
]

TYPOS = [
    ("The commitee met on Tuesday to discuss the budget for the coming year. After a long "
     "debate, the members agreed to increase spending on the library and the park."),
    ("Our new office is located on the third floor of the building next to the train "
     "station. Visitors should sign in at the recepton desk and wait to be collected."),
    ("The experiment was repeated five times to make sure the results were reliable. Each "
     "time, the temperature was recorded every ten minutes and the avarage was calculated."),
]

LISTS = [
    ('[{"id": 1, "name": "Alice", "role": "admin"}, {"id": 2, "name": "Bob", "role": "editor"}, '
     '{"id": 3, "name": "Carol", "role": "viewer"},'),
    ('[{"city": "Paris", "country": "France", "population": 2148000}, {"city": "Berlin", '
     '"country": "Germany", "population": 3645000}, {"city": "Madrid", "country": "Spain", '
     '"population": 3223000},'),
    ('[{"sku": "A-100", "price": 9.99, "in_stock": true}, {"sku": "A-101", "price": 12.5, '
     '"in_stock": false}, {"sku": "A-102", "price": 4.25, "in_stock": true},'),
]

FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "Write a poem about autumn rain.",
]


def grounded() -> list[str]:
    """The input-grounded requests, as user turns."""
    asks = [f"Rewrite this function with `{old}` renamed to `{new}`, changing nothing "
            f"else:\n\n```python\n{code}```" for old, new, code in FUNCTIONS]
    asks += [f"{q} Answer by quoting the passage.\n\nPassage: {p}" for q, p in PASSAGES]
    asks += [f"Fix the spelling mistake in this paragraph and write out the whole corrected "
             f"paragraph:\n\n{t}" for t in TYPOS]
    asks += [f"Continue this JSON list with five more items of the same shape:\n\n{items}"
             for items in LISTS]
    return asks


def decode(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[list[int], float, int,
                                                                        int]:
    """(tokens, decode tok/s after the first token, proposed, accepted)."""
    tokens: list[int] = []
    first = last = None
    out = None
    for out in llm.stream(ids, params):
        tokens += out.new_token_ids
        now = time.perf_counter()
        first = first or now
        last = now
    assert out is not None and first is not None and last is not None
    rate = (len(tokens) - 1) / (last - first) if last > first else float("nan")
    return tokens, rate, out.draft_tokens, out.accepted_tokens


def measure(plain: LLM, spec: LLM, prompt: str, params: SamplingParams, reps: int
            ) -> tuple[float, float, bool, int, int]:
    ids = plain.chat_prompt_ids([{"role": "user", "content": prompt}])
    base, fast, same, proposed, kept = [], [], True, 0, 0
    for _ in range(reps):
        want, r0, _, _ = decode(plain, ids, params)
        got, r1, d, a = decode(spec, ids, params)
        base.append(r0)
        fast.append(r1)
        same &= got == want
        proposed, kept = proposed + d, kept + a
    return statistics.median(base), statistics.median(fast), same, proposed, kept


def report(name: str, plain: LLM, spec: LLM, prompts: list[str], params: SamplingParams,
           reps: int) -> list[float]:
    print(f"\n{name}")
    print(f"{'#':>3} {'plain t/s':>10} {'spec t/s':>10} {'ratio':>6} {'accept':>7} "
          f"{'kept/proposed':>13} {'same':>5}  prompt")
    ratios, proposed, kept = [], 0, 0
    for i, prompt in enumerate(prompts):
        r0, r1, same, d, a = measure(plain, spec, prompt, params, reps)
        ratios.append(r1 / r0)
        proposed, kept = proposed + d, kept + a
        accept = f"{100 * a / d:.0f} %" if d else "-"
        match = ("yes" if same else "NO") if params.greedy else "-"  # sampled: same seed
        print(f"{i:>3} {r0:>10.1f} {r1:>10.1f} {r1 / r0:>6.2f} {accept:>7} "
              f"{f'{a}/{d}':>13} {match:>5}  {prompt[:48]!r}")
    rate = f" ({100 * kept / proposed:.0f} %)" if proposed else ""
    print(f"geometric mean ratio {statistics.geometric_mean(ratios):.2f}, "
          f"min {min(ratios):.2f}; {kept} of {proposed} proposed tokens accepted{rate}")
    return ratios


def engines(args: argparse.Namespace) -> tuple[LLM, LLM]:
    """(plain, speculative) on the default model, or on --draft-pair's target."""
    model, draft = None, args.draft_model
    if args.draft_pair is not None:
        target, pair_draft = pair_paths(args.draft_pair)
        model, draft = str(target), str(pair_draft)
    plain = LLM(model, EngineConfig(threads=args.t, max_num_seqs=1))
    spec = LLM(model, EngineConfig(threads=args.t, max_num_seqs=1,
                                   speculative="ngram" if draft is None else "draft",
                                   num_speculative=args.k, draft_model=draft,
                                   speculative_adaptive=not args.fixed_k))
    return plain, spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128, help="tokens to generate per prompt")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("-k", type=int, default=4, help="--num-speculative")
    ap.add_argument("-r", type=int, default=2, help="repetitions per prompt (median)")
    ap.add_argument("--fixed-k", action="store_true",
                    help="always propose -k tokens (no adaptive sizing)")
    ap.add_argument("--prompts", type=int, default=None, metavar="N",
                    help="only the first N prompts of each list")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--draft-model", default=None, metavar="PATH",
                        help="propose with this draft model instead of prompt lookup")
    source.add_argument("--draft-pair", type=Path, default=None, metavar="DIR",
                        help="bench/draft_pair.py's folder: its target, plain and with its "
                             "draft")
    args = ap.parse_args()
    plain, spec = engines(args)
    params = SamplingParams(max_tokens=args.n, temperature=0)
    decode(plain, plain.tokenizer.encode("Hello"), params)  # warm-up: pages in the weights
    decode(spec, spec.tokenizer.encode("Hello"), params)
    grounded_prompts, free_prompts = grounded()[:args.prompts], FREE[:args.prompts]
    report("input-grounded prompts", plain, spec, grounded_prompts, params, args.r)
    free = report("free generation (nothing to look up), greedy", plain, spec, free_prompts,
                  params, args.r)
    sampled = SamplingParams(max_tokens=args.n, temperature=1.0, seed=7)
    free += report("free generation, sampled (temperature 1, seed 7; the two runs draw "
                   "differently, so texts differ)", plain, spec, free_prompts, sampled, args.r)
    verdict = "holds" if min(free) >= 0.95 else "does NOT hold"
    print(f"\nfree generation: lowest speculative / plain ratio {min(free):.2f} "
          f"(>= 0.95 {verdict})")

if __name__ == "__main__":
    main()
