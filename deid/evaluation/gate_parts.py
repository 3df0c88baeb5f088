"""The gate's parallel-parts runner: the attackers, the utility protocols and the leak checks run as
separate parts on an executor's processes (:func:`parallel_parts`) or here (:func:`serial_parts`), with the
same figures; the samples read once (:class:`SampleFetch`); and a large release's helper process
(:class:`GateHelper`), which builds the inputs and runs the deep attackers ahead.
"""
from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping

import numpy as np

from deid.evaluation.attacks import DEEP_ATTACKERS
from deid.errors import StateError
from deid.evaluation.checks import Check
from deid.progress import PartsProgress, Progress

from deid.evaluation.gate_privacy import (attack_groups, attack_modes, attack_rows, gate_attack_sample,
                                          leak_checks, membership_disclosure, near_miss_records)
from deid.evaluation.gate_rows import AttackRow, UtilityRow
from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate_utility import cross_fit_checks, people_sample, protocol_rows, utility_checks

log = logging.getLogger(__name__)


def read_samples_once(inputs: GateInputs, config: GateConfig) -> GateInputs:
    """The same inputs whose ``fetch`` serves the attack and utility samples from one read.

    ``fetch`` streams the staged release from disk; the attacked sample and the utility sample
    differ when the release is large, and one pass over their union halves the reading.
    """
    if not inputs.n:
        return inputs
    wanted = [gate_attack_sample(inputs, config)]
    wanted.append(near_miss_records(inputs, config)[0])  # and the near misses' clusters (none: empty)
    if config.labels and inputs.deidentify is not None:
        wanted.append(people_sample(inputs, max_records=config.utility_sample, seed=config.seed, labels=config.labels))
    union = np.unique(np.concatenate(wanted)).astype(np.int64)
    if isinstance(inputs.fetch, SampleFetch) and np.array_equal(inputs.fetch.index, union):
        return inputs  # read already (a helper's prepared inputs, GateHelper)
    released, originals = inputs.fetch(union)
    return replace(inputs, fetch=SampleFetch(union, released, originals, inputs.fetch))


@dataclass(frozen=True)
class SampleFetch:
    """``fetch`` from pre-read rows ``index`` (sorted), other records from ``fallback``.

    Without a fallback (the copy sent to another process: a reader of the staged release does
    not travel) asking for other records is an error.
    """

    index: np.ndarray
    released: np.ndarray
    originals: np.ndarray
    fallback: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None

    def __call__(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64)
        at = np.searchsorted(self.index, idx)
        if len(idx) and (at.max() >= len(self.index) or not np.array_equal(self.index[at], idx)):
            if self.fallback is None:
                raise ValueError("records outside the gate's pre-read samples asked of a detached fetch")
            return self.fallback(idx)  # not one of the pre-read samples
        return self.released[at], self.originals[at]


# --------------------------------------------------------------------------- parallel parts


@dataclass(frozen=True)
class ParallelParts:
    """What :func:`parallel_parts` (or :func:`serial_parts`) computed: the attack rows in gate order, the utility
    checks and rows, and (when computed there) the leak checks and the membership disclosure."""

    attack_rows: list[AttackRow]
    utility: tuple[list[Check], list[UtilityRow]]
    leaks: list[Check] | None = None
    membership: dict | None = None


def worth_parallel(inputs: GateInputs, executor: Any) -> bool:
    """Worth running in parts: more than one worker, and the inputs travel to other processes."""
    if executor is None or getattr(executor, "workers", 1) < 2 or not isinstance(inputs.fetch, SampleFetch):
        return False
    try:
        pickle.dumps(inputs.deidentify)
    except Exception:  # noqa: BLE001 - any closure or lambda: run in this process
        log.debug("gate: the method runner cannot be sent to other processes; parts run here")
        return False
    return True


def gate_part(part: str, inputs: GateInputs, config: GateConfig, *, cap: int | None = None,
              attackers: tuple[str, ...] = (), descriptors: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """One part of the gate (a call of :func:`parallel_parts`): ``attack``, ``cross-fit``, ``protocols`` or ``leaks``.

    ``descriptors`` are (faces, dlib descriptors) the calling process already had: primed here,
    so a deep attacker embeds each original once per run, whichever process it runs in.
    """
    if descriptors is not None and len(descriptors[0]):
        from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

        DlibEmbedder(tuple(inputs.shape)).prime(*descriptors)
    if part == "attack":
        return attack_rows(inputs, config, cap=cap, attackers=attackers)
    if part == "cross-fit":
        return cross_fit_checks(inputs, config)
    if part == "protocols":
        return protocol_rows(inputs, config)
    if part == "leaks":
        return leak_checks(inputs, config)
    raise ValueError(f"part={part!r} must be 'attack', 'cross-fit', 'protocols' or 'leaks'")


def _timed_part(label: str, **kwargs: Any) -> tuple[str, float, Any]:
    """:func:`gate_part` with its name and measured seconds (for the gate's progress lines and time left)."""
    t0 = time.perf_counter()
    if isinstance(kwargs.get("inputs"), HelperInputs):
        kwargs["inputs"] = kwargs["inputs"].inputs  # a part run in this process: the inputs themselves
    result = gate_part(**kwargs)
    return label, time.perf_counter() - t0, result


# Relative prior costs of the gate's parts for the time-left estimate (deid.progress.PartsProgress scales
# them by the parts' measured seconds): the deep recogniser and the cross-fit dominate.
_PART_WEIGHT = {"attack-deep": 4.0, "cross-fit": 3.0, "protocols": 2.0, "membership": 2.0, "leaks": 1.0,
                "attack": 1.0}


def _part_label(call: Mapping[str, Any]) -> str:
    """A part's name in the progress lines: ``attack dlib-resnet``, ``cross-fit`` ..."""
    names = call.get("attackers") or ()
    return f"attack {'+'.join(names)}" + (f" (cap {call['cap']})" if call.get("cap") is not None else "") \
        if call["part"] == "attack" else call["part"]


def parallel_parts(inputs: GateInputs, config: GateConfig, executor: Any, *, large: bool = False,
                   ready: Mapping[tuple, Callable[[], Any]] | None = None, prepared: bool = False) -> ParallelParts:
    """The attackers (one call each) and the two utility parts as calls of ``executor``, longest first.

    Every part is a deterministic function of the inputs (seeded samples, seeded methods, one
    BLAS thread), so the figures are those of the serial gate, bit for bit; rows are put back in
    the serial order. The costly parts go first, so the processes finish close together.

    ``large`` (a large release's helper, :func:`start_helper`): the deep attackers first (the
    dlib recogniser embeds ~140 distinct faces, ~0.09 s each), then the other attackers of each
    cap as *one* call (they share its sample, parrot gallery and distinct images: one call each
    would redo those per attacker), the cross-fit, the evidence-only protocols and the leak
    checks; no part is computed twice.

    ``ready``: parts a :class:`GateHelper` ran ahead, ``(part, attackers)`` -> a call that waits
    for its result; they are not run again. ``prepared``: ``executor`` is a :class:`GateHelper`'s pool,
    whose process holds the per-record inputs it built: only the rest is sent (:class:`HelperInputs`).
    """
    ready = dict(ready or {})
    shipped: Any = replace(inputs, fetch=replace(inputs.fetch, fallback=None))
    if prepared:
        shipped = HelperInputs(shipped)
    groups = attack_groups(inputs, config)
    calls: list[dict] = []
    if config.labels and not large:
        calls.append(dict(part="cross-fit"))
    deep = [dict(part="attack", cap=cap, attackers=(name,)) for cap, group in groups
            for name in group if name in DEEP_ATTACKERS and ("attack", (name,)) not in ready]
    if deep and inputs.kind == "images":
        from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

        _, originals = inputs.fetch(gate_attack_sample(inputs, config))
        known = DlibEmbedder(tuple(inputs.shape)).known(originals)
        deep = [dict(c, descriptors=known) for c in deep]
    calls += deep
    light = [(cap, tuple(name for name in group if name not in DEEP_ATTACKERS)) for cap, group in groups]
    if large:
        calls += [dict(part="attack", cap=cap, attackers=names) for cap, names in light if names]
        calls += [dict(part="cross-fit"), dict(part="protocols")] if config.labels else []
        calls.append(dict(part="leaks"))
    else:
        calls += [dict(part="protocols")] if config.labels else []
        calls += [dict(part="attack", cap=cap, attackers=(name,)) for cap, names in light for name in names]
    labels = [_part_label(c) for c in calls]
    labels = [f"{x} #{i}" if labels.count(x) > 1 else x for i, x in enumerate(labels)]
    weights = [_PART_WEIGHT["attack-deep" if set(c.get("attackers", ())) & DEEP_ATTACKERS else c["part"]]
               for c in calls]
    progress = PartsProgress("gate", list(zip(labels, weights)), workers=getattr(executor, "workers", 1)).start()
    try:
        out = executor.map(_timed_part, [dict(c, label=x, inputs=shipped, config=config) for c, x in zip(calls, labels)],
                           on_done=lambda r: progress.done(r[0], r[1]))
    finally:
        progress.finish()
    done = {(c["part"], c.get("attackers", ())): r for c, (_, _, r) in zip(calls, out)}
    done.update({key: wait() for key, wait in ready.items()})
    by_attacker: dict[str, list[AttackRow]] = {}
    for (part, _), result in done.items():
        for r in result if part == "attack" else ():
            by_attacker.setdefault(r.attacker, []).append(r)
    rows = [r for _, group in groups for name in group for r in by_attacker.get(name, [])]
    utility = ((done["cross-fit", ()][0], done["cross-fit", ()][1] + done["protocols", ()]) if config.labels else
               utility_checks(inputs, config))
    return ParallelParts(attack_rows=rows, utility=utility, leaks=done.get(("leaks", ())))


def serial_parts(inputs: GateInputs, config: GateConfig) -> ParallelParts:
    """The gate's parts one after another in this process, with the progress of :func:`parallel_parts`.

    The serial gate (no pool: a study's evaluations, a run on one worker, a method runner that cannot
    travel) runs the same functions in the same order as before: each attack group (the attackers
    that share a sample, as one part: they share its parrot gallery and distinct images), the leak
    checks, the membership disclosure, the cross-fit and the evidence-only protocols. So its figures
    are unchanged; what it gains is the parallel path's :class:`deid.progress.PartsProgress`: the
    parts named up front, a line as each ends with its measured seconds, a heartbeat at least every
    15 s naming the running part, and the time left from the parts' measured costs (a group's prior
    weight is the sum of its attackers').
    """
    groups = attack_groups(inputs, config)
    # Within the attack parts, a line per attacker x mode pair as before (the parts' lines say which group runs).
    pairs = Progress(f"gate: attacks on {len(gate_attack_sample(inputs, config))} records",
                     unit="attacker x mode pairs").start(sum(len(g) for _, g in groups) * len(attack_modes(inputs, config)))
    plan: list[tuple[str, float, Callable[[], Any]]] = [
        (_part_label({"part": "attack", "cap": cap, "attackers": group}),
         sum(_PART_WEIGHT["attack-deep" if n in DEEP_ATTACKERS else "attack"] for n in group),
         lambda cap=cap, group=group: attack_rows(inputs, config, cap=cap, attackers=group,
                                                  on_pair=lambda a, m: pairs.advance(note=f"{a}/{m}")))
        for cap, group in groups]
    plan += [("leaks", _PART_WEIGHT["leaks"], lambda: leak_checks(inputs, config)),
             ("membership", _PART_WEIGHT["membership"], lambda: membership_disclosure(inputs, config))]
    if config.labels:
        plan += [("cross-fit", _PART_WEIGHT["cross-fit"], lambda: cross_fit_checks(inputs, config)),
                 ("protocols", _PART_WEIGHT["protocols"], lambda: protocol_rows(inputs, config))]
    names = [x for x, _, _ in plan]
    names = [f"{x} #{i}" if names.count(x) > 1 else x for i, x in enumerate(names)]
    progress = PartsProgress("gate", [(x, w) for x, (_, w, _) in zip(names, plan)], workers=1).start()
    done: dict[str, Any] = {}
    try:
        for name, (_, _, run) in zip(names, plan):
            t0 = time.perf_counter()
            done[name] = run()
            progress.done(name, time.perf_counter() - t0)
    finally:
        progress.finish()
    rows = [r for name in names[:len(groups)] for r in done[name]]  # the attack parts come first, in group order
    utility = ((done["cross-fit"][0], done["cross-fit"][1] + done["protocols"]) if config.labels else
               utility_checks(inputs, config))
    return ParallelParts(attack_rows=rows, utility=utility, leaks=done["leaks"], membership=done["membership"])


def helper_size(inputs: GateInputs, config: GateConfig) -> bool:
    """A release of at least ``helper_min_records`` records, judged in a process that may have children."""
    return wants_helper(inputs.n, config)


def start_helper() -> Any:
    """This process and one spawned helper, for a large release's gate: the same figures, about half the wall time.

    The gate's work is nearly fixed in N (bounded samples), and at 100,000 faces the run's other
    core is idle while it runs (the stages' workers are gone). Its parts
    (:func:`parallel_parts` with ``large=True``: the dlib attack, the other attackers together,
    the cross-fit, the evidence-only protocols, the leak checks) start in that order on whichever
    process is free; nothing is computed twice, so the CPU added is the helper's start (imports,
    the dlib model, the inputs sent: ~2-4 s measured on a busy machine).
    """
    from deid.pool import PoolExecutor  # noqa: PLC0415 (a base module: the pool without the stages' warm-up)

    return PoolExecutor(2, warm=None)


def wants_helper(records: int, config: GateConfig) -> bool:
    """Does a release of ``records`` records get a gate helper process (at least ``helper_min_records``)?"""
    import multiprocessing  # noqa: PLC0415

    if not config.helper_min_records or records < config.helper_min_records:
        return False
    return not multiprocessing.current_process().daemon  # a daemonic pool's process (a study's worker) has none


class GateHelper:
    """A large release's gate helper process, started before the gate: the run's other core works ahead.

    At 100,000 faces the run's second core is idle while the release is staged (the stages'
    workers have exited, staging runs in the run's process). Started then (:meth:`start`), the
    helper builds the gate's inputs (``build(**kwargs)``, e.g. streaming the records; they do not
    depend on the staged files) with their samples read, then runs the deep attackers
    (:data:`DEEP_ATTACKERS`, the gate's longest part: the dlib recogniser embeds ~140 faces, ~13
    CPU-s). The gate then takes the inputs (:meth:`inputs`), adds what staging found, and runs its
    other parts on this process and the helper (:func:`parallel_parts`, ``ready=``
    :meth:`ready`). Every part is the function the gate would call, on the same inputs: the
    figures are the gate's without a helper, bit for bit. The caller closes it (:meth:`close`).
    """

    def __init__(self, config: GateConfig, pool: Any, built: Any, deep: Any):
        self.config, self.pool, self._built, self._deep = config, pool, built, deep

    @classmethod
    def start(cls, config: GateConfig, build: Callable[..., GateInputs], /, **kwargs: Any) -> GateHelper:
        """Spawn the helper and queue its two jobs: ``build(**kwargs)`` with its samples read, then the deep attackers."""
        pool = start_helper()
        built = pool.submit(_prepare_inputs, build=build, config=config, kwargs=kwargs)
        deep = pool.submit(_prepared_deep_attacks, config=config)
        return cls(config, pool, built, deep)

    def inputs(self) -> GateInputs:
        """The inputs the helper built (waits for them); its samples read, ``fetch`` detached."""
        return self._built.result()

    def ready(self) -> dict[tuple, Callable[[], Any]]:
        """The parts the helper runs ahead, as :func:`parallel_parts` names them -> a call waiting for each."""
        inputs = self.inputs()
        keys = [("attack", (name,)) for _, group in attack_groups(inputs, self.config) for name in group
                if name in DEEP_ATTACKERS] if inputs.n and isinstance(inputs.fetch, SampleFetch) else []
        return {key: (lambda key=key: self._deep.result()[key]) for key in keys}

    def close(self) -> None:
        """Shut the helper down (a job still queued is cancelled; one running is waited for)."""
        self.pool.close()


_PREPARED: dict[str, GateInputs] = {}
"""In a :class:`GateHelper` process: the inputs its first job built, for its second job and the gate's parts."""

# The fields of GateInputs that grow with the release (one entry per record, or per republished cluster): a
# HelperInputs sent to the helper takes them from the inputs the helper built, never pickled again.
_PER_RECORD = ("people", "image_index", "own_distance", "fetch", "clusters", "partitions", "labels", "points",
               "republished")


def _helper_inputs(n: int, rest: Mapping[str, Any]) -> GateInputs:
    """In a :class:`GateHelper` process: the inputs it built (:data:`_PREPARED`) with the other fields ``rest``."""
    inputs = _PREPARED.get("inputs")
    if inputs is None or inputs.n != n:
        raise StateError(f"gate: the helper process holds {'no inputs' if inputs is None else f'{inputs.n} records'}"
                         f" but was sent a part on {n} records; the gate's parts must be sent to the GateHelper that "
                         "built the inputs (a bug: report it)")
    return replace(inputs, **rest)


@dataclass(frozen=True)
class HelperInputs:
    """The gate's inputs as a part sent to a :class:`GateHelper` carries them: pickled without the per-record fields.

    The helper built the inputs (:meth:`GateHelper.start`) and keeps them; the gate's own copy is
    the one it sent back, plus what staging found (``file_metadata``, ``extra_checks``). Pickling
    every record's person, cluster and labels again for each part held ~0.3 GiB more in this process
    and ~0.4 GiB in the helper at a million records (issue 32); the helper now takes those from its
    own copy and the rest from here, so each part sees the same inputs as before.
    """

    inputs: GateInputs

    def __reduce__(self) -> tuple[Any, ...]:
        rest = {f.name: getattr(self.inputs, f.name) for f in fields(self.inputs) if f.name not in _PER_RECORD}
        return _helper_inputs, (self.inputs.n, rest)


def _prepare_inputs(build: Callable[..., GateInputs], config: GateConfig, kwargs: Mapping[str, Any]) -> GateInputs:
    """A :class:`GateHelper`'s first job: ``build(**kwargs)``, its samples read once, ``fetch`` detached."""
    from deid.heap import release_free_memory  # noqa: PLC0415

    _PREPARED.clear()
    inputs = read_samples_once(build(**kwargs), config)
    if isinstance(inputs.fetch, SampleFetch):
        inputs = replace(inputs, fetch=replace(inputs.fetch, fallback=None))
    _PREPARED["inputs"] = inputs
    release_free_memory()  # what reading every record's row freed (its digests, batches): not kept for the attacks
    return inputs


def _prepared_deep_attacks(config: GateConfig) -> dict[tuple, list[AttackRow]]:
    """A :class:`GateHelper`'s second job: each deep attacker's rows (:func:`attack_rows`) on the first job's inputs.

    The inputs stay in :data:`_PREPARED`: the gate's parts sent here later use them (:class:`HelperInputs`).
    """
    from deid.heap import release_free_memory  # noqa: PLC0415

    inputs = _PREPARED.get("inputs")
    if inputs is None or not inputs.n or not isinstance(inputs.fetch, SampleFetch):
        return {}
    rows = {("attack", (name,)): gate_part("attack", inputs, config, cap=cap, attackers=(name,))
            for cap, group in attack_groups(inputs, config) for name in group if name in DEEP_ATTACKERS}
    release_free_memory()  # the embeddings' working memory: the helper then waits for the gate, holding nothing else
    return rows
