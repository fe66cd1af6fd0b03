"""What one pass over T tokens costs against one over 1 token, in the kernels alone: a chain of 60 fp32
MatMuls of SmolLM2's MLP shapes (30 x (576 x 1536, 1536 x 576): 212 MB of weights, more than any cache, as
a base pass reads 538 MB), timed in native onnxruntime and in onnxruntime-web's WASM build under Node.
docs/web.md ("Verifying several tokens on WASM") reports it. Run from the repository root, nothing else busy:

    python bench/kernels/verify_cost.py [--ort-web DIR]   # DIR: a node_modules/onnxruntime-web (default web's)
"""
import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

TS = (1, 2, 3, 4, 5, 8)
JS = """
const [dir, path, threads, ts] = process.argv.slice(2);
const ort = await import(dir + '/dist/ort.node.min.mjs');
ort.env.wasm.numThreads = +threads;
const s = await ort.InferenceSession.create(path, { executionProviders: ['wasm'] });
const out = {};
for (const T of JSON.parse(ts)) {
  const x = new ort.Tensor('float32', new Float32Array(T * 576).fill(0.01), [T, 576]);
  for (let i = 0; i < 3; i++) await s.run({ x });
  const ms = [];
  for (let i = 0; i < 12; i++) { const t0 = performance.now(); await s.run({ x }); ms.push(performance.now() - t0); }
  out[T] = ms.sort((a, b) => a - b)[6];
}
console.log(JSON.stringify(out));
"""


def chain(path: Path, layers: int = 30, d: int = 576, f: int = 1536):
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(2 * layers):
        a, b = (d, f) if i % 2 == 0 else (f, d)
        inits.append(numpy_helper.from_array((rng.standard_normal((a, b)) * 0.05).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", d])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["T", d])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


def native(path: Path, threads: int) -> dict:
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = threads
    s = onnxruntime.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    out = {}
    for t in TS:
        x = np.full((t, 576), 0.01, np.float32)
        for _ in range(3):
            s.run(None, {"x": x})
        ms = []
        for _ in range(12):
            t0 = time.perf_counter()
            s.run(None, {"x": x})
            ms.append((time.perf_counter() - t0) * 1e3)
        out[t] = sorted(ms)[6]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ort-web", type=Path, default=Path("web/node_modules/onnxruntime-web"))
    args = ap.parse_args()
    version = json.loads((args.ort_web / "package.json").read_text())["version"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chain.onnx"
        chain(path)
        rows = [(f"onnxruntime {onnxruntime.__version__}, native", th, native(path, th)) for th in (1, 2)]
        for th in (1, 2):
            script = Path(tmp) / "time.mjs"  # a file, not `node -e`: the WASM threads are workers loading modules
            script.write_text(JS)
            js = subprocess.run(["node", str(script), str(args.ort_web.resolve()), str(path), str(th), json.dumps(TS)],
                                capture_output=True, text=True)
            if js.returncode:
                raise SystemExit(f"node failed:\n{js.stderr}")
            rows.append((f"onnxruntime-web {version}, WASM (Node)", th, {int(k): v for k, v in json.loads(js.stdout.splitlines()[-1]).items()}))
    print("| runtime | threads | " + " | ".join(f"T = {t}, ms" for t in TS) + " | T = 5 / T = 1 |")
    print("| --- | --- | " + " | ".join("---" for _ in TS) + " | --- |")
    for name, th, ms in rows:
        print(f"| {name} | {th} | " + " | ".join(f"{ms[t]:.1f}" for t in TS) + f" | {ms[5] / ms[1]:.2f}x |")


if __name__ == "__main__":
    main()
