"""A test drafter: the engine's DSpark speculator (same compiled steps) whose drafts an oracle fixes.

``oracle(SpecLaunch) -> int32 [len(rows), γ]`` (−1: the draft's own proposal) is asked for every DSpark
launch with rows; the launch then runs the production steps (`DSparkSpeculator.batch`,
`grammar_masks`, `verify`) with those drafts, through the step's drafts input (the one constrained rows
use). ``launched`` keeps each launch and its result ([(SpecLaunch, LaunchResult)]).
"""

import contextlib

import numpy as np

from dsv41_jax.serving import speculator as spr


class OracleDrafter(spr.DSparkSpeculator):
    def __init__(self, base: spr.DSparkSpeculator, oracle):
        self.__dict__.update(base.__dict__)
        self.oracle = oracle
        self.launched: list = []

    def launch(self, params, dev, L, warm=False):
        if warm or not L.rows:
            return super().launch(params, dev, L, warm)
        batch, step = self.batch(L)
        drafts = np.full((L.B, self.gamma), -1, np.int32)
        drafts[:len(L.rows)] = np.asarray(self.oracle(L), np.int32)
        allowed = self.grammar_masks(params, dev, L, batch, step, drafts)
        dev, res = self.verify(params, dev, L, batch, step, drafts, allowed)
        self.launched.append((L, res))
        return dev, res

    def accepts(self) -> list:
        """Per launch, its rows' accept counts."""
        return [np.asarray(res.n_accept)[:len(L.rows)].tolist() for L, res in self.launched]


@contextlib.contextmanager
def oracle_drafts(eng, oracle):
    """``eng``'s speculator replaced by an `OracleDrafter` while the block runs; yields the drafter."""
    base = eng.runner.speculator
    eng.runner.speculator = drafter = OracleDrafter(base, oracle)
    try:
        yield drafter
    finally:
        eng.runner.speculator = base
