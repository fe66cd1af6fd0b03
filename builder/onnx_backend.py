"""The decode loop's backend over the exported ONNX graphs, with onnxruntime on the CPU.

It satisfies the interface `builder.generate.decode` drives (`context`, `prefill`, `verify`,
`rollback`, `draft`), as TorchBackend does, and runs what the browser runs. Plain decoding: one base
run per step. With the head, as the page does: two runs per speculative step, the head graph that
drafts exactly k (`head_k{k}`, opened when first used) and the base verifying k + 1. fused=True runs
ONE step-graph run per step instead - it verifies, applies the acceptance rule and drafts the next
full chain of K from the new anchor - so `draft` returns drafts computed by the previous `verify` (the
head graph runs only for the first step, and whenever the loop rolled back to another length than the
graph's acceptance, which the one decode loop never does); it always drafts K. With the drafter: its
own cache, one drafter run per draft (builder/drafter.py). Everything it needs to know
about the graphs - input and output names, KV layout, K, the head's KV layer - comes from
manifest.json; every file is checked against the manifest's size and sha256 before a session opens.
precision="fp16" runs the half-precision graphs (onnxruntime on the CPU computes what it has no fp16
kernel for in fp32, so this checks the graphs and the page's fp16 plumbing, not WebGPU's fp16 rounding).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .drafter import IndependentDrafter
from .export import read_manifest
from .model import CheckpointError


@dataclass
class OnnxState:
    cache: dict[str, np.ndarray]  # past input name -> (1, S, n_kv, head_dim): positions 0..S-1
    hidden: np.ndarray            # (1, T, C) the base's hidden output for the last T fed tokens; the last is the anchor
    ids: list[int]                # the S tokens in the cache
    ahead: tuple[int, int, list[int]] | None = None  # step graph: (accepted n, the base's choice at fed
                                                     # position n, the K drafts after it)


class OnnxBackend:
    def __init__(self, directory: str | Path, with_head: bool = False, fused: bool = False, threads: int = 1,
                 with_drafter: bool = False, precision: str = "fp32"):
        import onnxruntime as ort

        self.directory = Path(directory)
        self.manifest = m = read_manifest(self.directory)
        if with_head and m.get("head") is None:
            raise CheckpointError(f"{self.directory / 'manifest.json'} has no head graph: export with a head")
        if with_drafter and m.get("drafter") is None:
            raise CheckpointError(f"{self.directory / 'manifest.json'} has no drafter graph: export with a drafter")
        if with_head and with_drafter:
            raise ValueError("one draft source: the head or the drafter")
        if precision not in m.get("precisions", {"fp32": ""}):
            raise CheckpointError(f"{self.directory / 'manifest.json'} has no {precision} graphs: export them")
        if precision == "fp16" and fused:
            raise ValueError("the fused step graph is exported in fp32 only")
        self.float = np.float16 if precision == "fp16" else np.float32
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.log_severity_level = 3

        def session(graph: str):
            spec = m["graphs"][graph]["fp16"] if precision == "fp16" else m["graphs"][graph]
            return ort.InferenceSession(str(self.directory / spec["file"]), so,
                                        providers=["CPUExecutionProvider"])

        self.base = session("base")
        self.session = session
        self.heads = {}  # k -> the head graph drafting exactly k, opened when first used
        self.with_head = with_head
        self.step = session("step") if with_head and fused else None
        self.drafter = self.independent_drafter(session("drafter")) if with_drafter else None
        self.context = m["context_length"]
        self.k_max = m["head"]["k"] if with_head else 0  # the head graph drafts K; the drafter any k
        kv = m["kv"]
        self.past = kv["past_inputs"]                               # past_key_0, past_value_0, ..
        self.present = dict(zip(kv["present_outputs"], self.past))  # present name -> past name it feeds
        self.kv_shape = kv["shape"]
        self.outputs = ["choices", "margins", "hidden", *kv["present_outputs"]]
        self.step_outputs = self.outputs[:3] + ["accepted", "drafts"] + self.outputs[3:]
        # head input -> the cache entry it reads (the base's present of the head's KV layer, rolled back)
        self.head_kv = {name: self.present[out] for name, out in m["head"]["kv_inputs"].items()} if with_head else {}
        self.runs = 0  # session.run calls, for the calls-per-step count
        self.run_seconds = defaultdict(list)  # "base T=5", "head k=4", ..: the wall time of each such run

    def _run(self, session, what: str, outputs: list[str], feeds: dict) -> list:
        t0 = time.perf_counter()
        out = session.run(outputs, feeds)
        self.run_seconds[what].append(time.perf_counter() - t0)
        self.runs += 1
        return out

    def _base(self, state_cache: dict[str, np.ndarray], state_ids: list[int], ids: list[int], step: bool = False):
        feeds = {"input_ids": np.array([ids], dtype=np.int64), **state_cache}
        ahead = None
        if step:
            choices, margins, hidden, accepted, drafts, *present = self._run(self.step, f"step T={len(ids)}",
                                                                             self.step_outputs, feeds)
            n = int(accepted[0])
            ahead = (n, int(choices[0, n]), drafts[0].tolist())
        else:
            choices, margins, hidden, *present = self._run(self.base, f"base T={len(ids)}", self.outputs, feeds)
        cache = {self.present[name]: t for name, t in zip(self.outputs[3:], present)}
        return choices[0].tolist(), margins[0].tolist(), OnnxState(cache, hidden, state_ids + ids, ahead)

    def prefill(self, ids: list[int]) -> OnnxState:
        empty = np.zeros([1, 0, *self.kv_shape[2:]], dtype=self.float)  # S = 0: no past yet
        return self._base({name: empty for name in self.past}, [], ids)[2]

    def verify(self, state: OnnxState, ids: list[int]):
        # a plain step (nothing drafted) needs no next drafts: the loop drafts only when it continues
        return self._base(state.cache, state.ids, ids, step=self.step is not None and len(ids) > 1)

    def rollback(self, state: OnnxState, n_fed: int) -> OnnxState:
        """Keep the first n_fed of the tokens just verified: a prefix view on the sequence axis, no copy."""
        drop = state.hidden.shape[1] - n_fed
        ahead = state.ahead if state.ahead and state.ahead[0] + 1 == n_fed else None  # drafted from this anchor
        if drop == 0:
            return OnnxState(state.cache, state.hidden, state.ids, ahead)
        keep = len(state.ids) - drop
        return OnnxState({name: t[:, :keep] for name, t in state.cache.items()}, state.hidden[:, :n_fed],
                         state.ids[:keep], ahead)

    def independent_drafter(self, session) -> IndependentDrafter:
        """The drafter graph behind the one drafting logic of builder/drafter.py (its own cache, by prefix)."""
        kv = self.manifest["drafter"]["kv"]
        present_to_past = dict(zip(kv["present_outputs"], kv["past_inputs"]))
        outputs = ["choices", *kv["present_outputs"]]
        empty = np.zeros([1, 0, *kv["shape"][2:]], dtype=self.float)

        def forward(ids, cache):
            feeds = {"input_ids": np.array([ids], dtype=np.int64),
                     **(cache if cache is not None else {name: empty for name in kv["past_inputs"]})}
            choices, *present = self._run(session, f"drafter T={len(ids)}", outputs, feeds)
            return int(choices[0, -1]), {present_to_past[n]: t for n, t in zip(kv["present_outputs"], present)}

        return IndependentDrafter(forward, lambda cache, n: {name: t[:, :n] for name, t in cache.items()})

    def draft(self, state: OnnxState, token: int, k: int) -> list[int]:
        if self.drafter is not None:
            return self.drafter.draft(state.ids + [token], k)
        if not self.with_head:
            raise ValueError("this backend has no draft source")
        if k > self.k_max:
            raise ValueError(f"the head graph drafts {self.k_max} tokens, {k} asked")
        if k not in self.heads:
            self.heads[k] = self.session(self.manifest["head"]["by_k"][str(k)])
        if state.ahead is not None and state.ahead[1] == token:  # the step graph drafted from this anchor
            return state.ahead[2][:k]
        feeds = {"hidden": state.hidden, "anchor": np.array([state.hidden.shape[1] - 1], dtype=np.int64),
                 "token": np.array([[token]], dtype=np.int64),
                 **{name: state.cache[past] for name, past in self.head_kv.items()}}
        (drafts,) = self._run(self.heads[k], f"head k={k}", ["drafts"], feeds)
        return drafts[0, :k].tolist()
