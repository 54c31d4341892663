"""The sizes of every attention variant at matched key/value-cache bytes and at matched attention parameters
(collab_attn/char_lm/budgets.py), read from the models built on the meta device.

    python scripts/kv_budgets.py                       # the cpu recipe: 1/2, 1/4, 1/8 of the cache; 0.75, 0.625 params
    python scripts/kv_budgets.py --recipe gpu --fractions 0.25
    python scripts/kv_budgets.py --positions rope     # the rotary variants (issue 69), tensor product attention too

Prints two Markdown tables: per target fraction and variant, the rank closest to it and the ratio reached.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from collab_attn import cli
from collab_attn.char_lm.budgets import all_sizes, matched, table

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipe"


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"a fraction in (0, 1], got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(p.stem for p in RECIPES.glob("*.yaml")), default="cpu")
    parser.add_argument("--fractions", type=fraction, nargs="+", default=[0.5, 0.25, 0.125],
                        help="targets for the cache bytes per token")
    parser.add_argument("--param-fractions", type=fraction, nargs="+", default=[0.75, 0.625],
                        help="targets for the attention parameters")
    parser.add_argument("--positions", choices=["learned", "rope"], default="learned",
                        help="rope: the variants as rotary (Llama-architecture) models, tensor product attention too")
    args = parser.parse_args(argv)
    model = OmegaConf.to_container(OmegaConf.load(RECIPES / f"{args.recipe}.yaml"))["model"]
    sizes = all_sizes(model, positions=args.positions)
    print(f"recipe {args.recipe}, positions {args.positions}: {model}\n")
    print(table(matched(sizes, args.fractions, "cache_bytes"), "cache_bytes"))
    print()
    print(table(matched(sizes, args.param_fractions, "attention_params"), "attention_params"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
