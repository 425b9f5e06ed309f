"""Simulation adversaries: miner strategies that misbehave, injected into the miner duty.

`lazy` submits the global state unchanged, `noise` submits it with large random noise, `copier`
commits the first other miner's commitment and reveals that miner's blob as its own, `late`
commits only after the COMMIT window (its own node refuses to send it; the refusal is logged),
`garbage` commits to random bytes. `miner_factory(behaviour)` gives the DutiesFactory of the miner
playing a behaviour ("honest" included); `python -m node.sim.adversaries BEHAVIOUR miner --config FILE`
is how the simulator starts such a miner (a `SimNode.program`): `tessera miner` with those duties.
A node's config has no behaviour, and production code never imports this module. It knows nothing
about scoring or merging.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch

from node.duties.consensus import wait_until
from node.duties.miner import HonestStrategy, Job, MinerDuties
from node.net.network import NetworkError
from node.runtime.context import DutiesFactory
from protocol.messages import Commit
from protocol.rounds import Phase
from validator.checks import submission_cap

log = logging.getLogger(__name__)

COPY_WAIT_SHARE = 0.6  # of COMMIT: how long a copier waits for a commitment to copy
NOISE_SCALE = 5.0
"""Noise std as a multiple of each tensor's std: it drowns the experts' outputs. That raises the loss
of a base that predicts its data well, but lowers it while the state is worse than a uniform guess,
as a tiny base that never read the skills is on them in the first rounds (docs/learning.md as of commit
3cb31c3)."""
GARBAGE_BYTES = 4096


class Lazy(HonestStrategy):
    name = "lazy"

    def build(self, job: Job) -> bytes:
        return job.encode(dict(job.base.tensors))


class Noise(HonestStrategy):
    name = "noise"

    def build(self, job: Job) -> bytes:
        generator = torch.Generator().manual_seed(job.seed)
        return job.encode({name: t + NOISE_SCALE * t.std() * torch.randn(t.shape, generator=generator)
                           for name, t in job.base.tensors.items()})


class Garbage(HonestStrategy):
    name = "garbage"

    def build(self, job: Job) -> bytes:
        generator = torch.Generator().manual_seed(job.seed)
        return torch.randint(0, 256, (GARBAGE_BYTES,), dtype=torch.uint8, generator=generator).numpy().tobytes()


class Late(HonestStrategy):
    """Builds honestly, commits nothing in COMMIT, and tries to commit once COMMIT is over."""

    name = "late"

    async def commitment(self, duty: MinerDuties, round: int) -> str | None:
        return None

    async def before_reveal(self, duty: MinerDuties, round: int, commitment: str | None) -> bool:
        submission = await duty.ctx.storage.submission(round)
        if submission is not None:
            schedule = duty.ctx.schedule
            late = schedule.phase_window(round, Phase.COMMIT)[1] + schedule.clock_skew_s
            while duty.ctx.clock.now() < late:  # a wait ends early if the clock is stepped back
                await duty.ctx.clock.sleep_until(late)
            await duty.publish(Commit(round=round, commitment=submission.hash))
        return False


class Copier(HonestStrategy):
    """Trains nothing; commits the first other miner's commitment and fetches its blob to reveal it."""

    name = "copier"
    trains = False

    def __init__(self) -> None:
        self._victims: dict[int, str] = {}

    async def commitment(self, duty: MinerDuties, round: int) -> str | None:
        start, end = duty.ctx.schedule.phase_window(round, Phase.COMMIT)
        found: list[str] = []

        async def other_commit() -> bool:
            others = [c for c in await duty.ctx.storage.commits_for(round) if c.miner != duty.me]
            if others:
                first = min(others, key=lambda c: (c.received_at, c.miner))
                found[:] = [first.commitment, first.miner]
            return bool(found)

        if not await wait_until(duty.ctx.clock, duty.arrivals, other_commit, start + COPY_WAIT_SHARE * (end - start)):
            return None
        commitment, self._victims[round] = found
        log.info("round %d: copying the commitment %s of miner %s", round, commitment[:12], found[1][:12])
        return commitment

    async def before_reveal(self, duty: MinerDuties, round: int, commitment: str | None) -> bool:
        victim = self._victims.pop(round, None)
        if commitment is None or victim is None:
            return False

        async def revealed() -> bool:
            return any(r.miner == victim for r in await duty.ctx.storage.reveals_for(round))

        await wait_until(duty.ctx.clock, duty.arrivals, revealed, duty.ctx.schedule.phase_window(round, Phase.REVEAL)[1])
        model = await duty.model.get()
        cap = submission_cap(duty.ctx.spec, model.shapes)
        try:
            await duty.ctx.network.fetch(commitment, [victim], cap)
        except (NetworkError, OSError) as exc:
            log.warning("round %d: cannot fetch the copied blob: %s", round, exc)
            return False
        return True


STRATEGIES: dict[str, type[HonestStrategy]] = {
    s.name: s for s in (HonestStrategy, Lazy, Noise, Garbage, Late, Copier)
}


def miner_factory(behaviour: str) -> DutiesFactory:
    """The miner duties playing `behaviour` (a STRATEGIES name)."""
    if behaviour not in STRATEGIES:
        raise ValueError(f"unknown miner behaviour {behaviour!r}; one of {', '.join(STRATEGIES)}")
    return MinerDuties.factory(STRATEGIES[behaviour]())


def main(argv: Sequence[str]) -> int:
    """`BEHAVIOUR miner --config FILE`: the `tessera miner` of that config, playing BEHAVIOUR."""
    from node.cli.daemon import run_daemon
    from node.cli.main import build_parser, run
    from training.allocator import set_policy

    set_policy()
    behaviour, *tessera = argv
    args = build_parser().parse_args(tessera)
    return run(lambda parsed: run_daemon(parsed, miner_factory(behaviour)), args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
