"""The probes shipped beside a built-in policy, rebuilt byte for byte: PAIR and every baseline
probe fitted on the policy's own labelled turns, as a run with the default flags fits them
(lab/methods/onpolicy.py, which also fits them on the fly for a run's other settings).

    python -m lab.onpolicy --env shop       # data/shop-policy/probes/, which grpo.py reads
    python -m lab.onpolicy --env shop-long  # data/shop-long-policy/probes/
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

import grpo
import pair
import probes
from lab.methods import onpolicy
from lab.worlds import shop


def main(argv=None) -> None:
    """python -m lab.onpolicy --env shop: fit the built-in policy's probes as the default run
    fits them (its flags, preset and seed) and write them beside it, in data/<policy>/probes/,
    byte for byte the same every time (the fit's durations are left out)."""
    ap = argparse.ArgumentParser(prog="python -m lab.onpolicy", description=main.__doc__)
    ap.add_argument("--env", default="shop", choices=tuple(shop.WORLDS))
    env = ap.parse_args(argv).env
    cache = os.environ.get("PAIR_CACHE")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["PAIR_CACHE"] = tmp                  # a fresh fit, never a cached one
            # grpo's flags and this module's, with their defaults, as python -m lab.train has them
            parser = grpo.train_parser(worlds=shop.WORLDS)
            onpolicy.add_flags(parser)
            args = grpo.parse_args(["--env", env, "--out", str(Path(tmp) / "run")], parser,
                                   worlds=shop.WORLDS)
            procs = pair.Processes()
            grpo.resolve_preset(args, procs, shop.WORLDS)
            torch.set_num_threads(args.threads)
            policy, tok = grpo.load_policy(args, procs, shop.WORLDS)    # as a run's, draw for draw
            fitted, report = onpolicy.shop_probes(args, policy, tok, procs, print)
            report.pop("seconds", None)
            out = Path(args.model) / "probes"
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(fitted, out, ignore=shutil.ignore_patterns("probes.json"))
            for path in out.rglob("*.safetensors"):        # a fit's duration is not its result
                probe = probes.Probe.load(path)
                probe.info.pop("fit_seconds", None)
                probe.save(path)
            grpo.write_json(out / "probes.json", report)
    finally:                                # the caller's cache, as it was
        if cache is None:
            os.environ.pop("PAIR_CACHE", None)
        else:
            os.environ["PAIR_CACHE"] = cache
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
