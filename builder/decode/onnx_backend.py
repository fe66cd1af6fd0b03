"""The decode loop's backend over the exported ONNX graphs, with onnxruntime on the CPU.

It satisfies the interface `builder.generate.decode` drives (`context`, `prefill`, `verify`,
`rollback`, `draft`), as TorchBackend does, and runs what the page runs. Plain decoding: one base run
per step. With the head: two runs per speculative step, the head graph of the mode's k (`head_k{k}`,
which the page opens too: near the end of a generation, when fewer drafts are allowed, its first ones
are taken) and the base verifying them. With the drafter: its own cache, one drafter run per draft
(drafter.py). Everything it needs to know about the graphs - input and output names, KV
layout, the head's KV layer, the weights files - comes from manifest.json; every file is checked
against the manifest's size and sha256 before a session opens. precision="fp16" runs the
half-precision graphs (onnxruntime on the CPU computes what it has no fp16 kernel for in fp32, so this
checks the graphs and the page's fp16 plumbing, not WebGPU's fp16 rounding).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from ..contract import read_manifest
from ..errors import CheckpointError
from .drafter import IndependentDrafter


def adapter_feeds(directory: Path, manifest: dict, task: str | None, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The base graph's adapter inputs for a task (manifest["adapters"]): its adapter's tensors, each transposed
    and scaled as the manifest says, or zeros (the base alone) for task None; {} for a graph without them."""
    spec = manifest.get("adapters")
    if spec is None:
        if task is not None:
            raise CheckpointError(f"the export in {directory} holds no adapters: export it with the {task} adapter")
        return {}
    if task is not None and task not in spec["by_task"]:
        raise CheckpointError(f"the export in {directory} has no adapter for {task!r} (it has {', '.join(spec['by_task'])})")
    state = load_file(directory / spec["by_task"][task]) if task else None
    shapes = {i["name"]: i["shape"] for i in manifest["precisions"][next(iter(manifest["precisions"]))]["graphs"]["base"]["inputs"]}
    return {name: (state[key].astype(np.float32).T * np.float32(scale)).astype(dtype) if state
            else np.zeros(shapes[name], dtype) for name, (key, scale) in spec["inputs"].items()}


@dataclass
class OnnxState:
    cache: dict[str, np.ndarray]  # past input name -> (1, S, n_kv, head_dim): positions 0..S-1
    hidden: np.ndarray            # (1, T, C) the base's hidden output for the last T fed tokens (after a prefill, its
                                  # last only); the last is the anchor
    embeds: np.ndarray | None     # (1, T, C) the embeddings of the base's choices there, when a head reads them
    choices: list[int]            # the base's choices there
    ids: list[int]                # the S tokens in the cache


class OnnxBackend:
    """source: None (plain decoding), "head" (the MTP head drafting with the graph of k drafts) or
    "drafter" (the independent drafter)."""

    def __init__(self, directory: str | Path, source: str | None = None, k: int = 0, precision: str = "fp32",
                 threads: int = 1, adapter: str | None = None):
        import onnxruntime as ort

        self.directory = Path(directory)
        self.manifest = m = read_manifest(self.directory)
        where = self.directory / "manifest.json"
        if source not in (None, "head", "drafter"):
            raise ValueError(f"unknown draft source {source!r}")
        if source and m.get(source) is None:
            raise CheckpointError(f"{where} has no {source} graph: export with a {source}")
        if source and not 1 <= k <= m[source]["k"]:
            raise ValueError(f"the {source} drafts 1 to {m[source]['k']} tokens a step, {k} asked")
        if precision not in m["precisions"]:
            why = " (only a base imported from a GGUF has them)" if precision == "q4" else ": export them"
            raise CheckpointError(f"{where} has no {precision} graphs{why}")
        self.graphs = m["precisions"][precision]["graphs"]
        self.float = np.dtype(m["precisions"][precision]["dtype"])
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.log_severity_level = 3
        # the weights are external data next to each graph file (shared by several graphs)
        session = lambda name: ort.InferenceSession(str(self.directory / self.graphs[name]["file"]), so,  # noqa: E731
                                                    providers=["CPUExecutionProvider"])
        self.context = m["context_length"]
        kv = m["kv"]
        self.past = kv["past_inputs"]                               # past_key_0, past_value_0, ..
        self.present = dict(zip(kv["present_outputs"], self.past))  # present name -> past name it feeds
        self.kv_shape = kv["shape"]
        base_out = [o["name"] for o in self.graphs["base"]["outputs"]]
        self.outputs = ["choices", "margins", "hidden", *(["embeds"] if "embeds" in base_out else []), *kv["present_outputs"]]
        self.run_seconds = defaultdict(list)  # "base T=5", "head k=4", ..: the wall time of each such run
        self.base = session("base")
        self.adapter = adapter_feeds(self.directory, m, adapter, self.float)  # the feature's production model
        self.head = self.drafter = None
        if source == "head":
            self.k, self.head = k, session(m["head"]["by_k"][str(k)])
            # head input -> the cache entry it reads (the base's present of the head's KV layer, rolled back)
            self.head_kv = {name: self.present[out] for name, out in m["head"]["kv_inputs"].items()}
            self.head_embeds = "embeds" in [i["name"] for i in self.graphs[m["head"]["by_k"][str(k)]]["inputs"]]
        elif source == "drafter":
            self.drafter = self.independent_drafter(session("drafter"))

    @property
    def runs(self) -> int:
        """session.run calls so far (every kind)."""
        return sum(len(s) for s in self.run_seconds.values())

    def _run(self, session, what: str, outputs: list[str], feeds: dict) -> list:
        t0 = time.perf_counter()
        out = session.run(outputs, feeds)
        self.run_seconds[what].append(time.perf_counter() - t0)
        return out

    def _base(self, state_cache: dict[str, np.ndarray], state_ids: list[int], ids: list[int], last_only: bool = False):
        """The base on ids after the cache: its choices after every id (a verify) or after the last (a prefill)."""
        at = [len(ids) - 1] if last_only else range(len(ids))
        feeds = {"input_ids": np.array([ids], dtype=np.int64), "outputs_at": np.array(at, dtype=np.int64), **state_cache,
                 **self.adapter}
        out = dict(zip(self.outputs, self._run(self.base, f"base T={len(ids)}", self.outputs, feeds)))
        cache = {past: out[name] for name, past in self.present.items()}
        choices, margins, hidden, embeds = out["choices"][0].tolist(), out["margins"], out["hidden"], out.get("embeds")
        return choices, margins[0].tolist(), OnnxState(cache, hidden, embeds, choices, state_ids + ids)

    def prefill(self, ids: list[int]) -> OnnxState:
        empty = np.zeros([1, 0, *self.kv_shape[2:]], dtype=self.float)  # S = 0: no past yet
        return self._base({name: empty for name in self.past}, [], ids, last_only=True)[2]

    def verify(self, state: OnnxState, ids: list[int]):
        return self._base(state.cache, state.ids, ids)

    def rollback(self, state: OnnxState, n_fed: int) -> OnnxState:
        """Keep the first n_fed of the tokens just verified: a prefix view on the sequence axis, no copy."""
        drop = state.hidden.shape[1] - n_fed
        if drop == 0:
            return state
        keep = len(state.ids) - drop
        embeds = state.embeds[:, :n_fed] if state.embeds is not None else None
        return OnnxState({name: t[:, :keep] for name, t in state.cache.items()}, state.hidden[:, :n_fed],
                         embeds, state.choices[:n_fed], state.ids[:keep])

    def independent_drafter(self, session) -> IndependentDrafter:
        """The drafter graph behind the one drafting logic of builder/decode/drafter.py (its own cache, by prefix)."""
        kv = self.manifest["drafter"]["kv"]
        present_to_past = dict(zip(kv["present_outputs"], kv["past_inputs"]))
        outputs = ["choices", *kv["present_outputs"]]
        empty = np.zeros([1, 0, *kv["shape"][2:]], dtype=self.float)

        def forward(ids, cache):
            feeds = {"input_ids": np.array([ids], dtype=np.int64), "outputs_at": np.array([len(ids) - 1], dtype=np.int64),
                     **(cache if cache is not None else {name: empty for name in kv["past_inputs"]})}
            choices, *present = self._run(session, f"drafter T={len(ids)}", outputs, feeds)
            return int(choices[0, 0]), {present_to_past[n]: t for n, t in zip(kv["present_outputs"], present)}

        return IndependentDrafter(forward, lambda cache, n: {name: t[:, :n] for name, t in cache.items()})

    def draft(self, state: OnnxState, token: int, k: int) -> tuple[list[int], list[float] | None]:
        if self.drafter is not None:
            return self.drafter.draft(state.ids + [token], k), None  # greedy ids, no probabilities
        if self.head is None:
            raise ValueError("this backend has no draft source")
        if k > self.k:
            raise ValueError(f"this backend's head graph drafts {self.k} tokens, {k} asked")
        feeds = {"hidden": state.hidden, "anchor": np.array([state.hidden.shape[1] - 1], dtype=np.int64)}
        if self.head_embeds:  # a draft vocabulary: the graph reads the embedding of the base's choice
            if token != state.choices[-1]:
                return [], None  # the prompt's last token, not the base's choice: nothing to draft from (loop.py)
            feeds["embeds"] = state.embeds
        else:
            feeds["token"] = np.array([[token]], dtype=np.int64)
        feeds |= {name: state.cache[past] for name, past in self.head_kv.items()}
        drafts, confidence = self._run(self.head, f"head k={self.k}", ["drafts", "confidence"], feeds)
        # the graph of the mode's k; near the end only its first k are allowed
        return drafts[0, :k].tolist(), confidence[0, :k].tolist()
