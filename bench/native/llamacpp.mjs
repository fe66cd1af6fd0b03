// The benchmark's native peer: llama.cpp on the CPU, through node-llama-cpp's prebuilt linux-x64 binary
// (@node-llama-cpp/linux-x64), on the same GGUF file as the page's base; greedy, fed token ids as given
// (no chat template, no BOS added), one prompt after another. builder/bench/native.py runs it.
//
//   node llamacpp.mjs --model FILE.gguf --n-predict N [--threads T] [--no-warmup]  < prompts.json
//
// prompts.json is a list of prompts, each a list of token ids. Prints one JSON object on stdout:
//   { llamacpp_info: { node_llama_cpp, llama_cpp, threads, ... }, results: [{ ids, prompt_tokens, prefill_ms,
//     decode_ms, tokens_per_s, total_ms, timings }] }
//
// Timed as the page times itself: prefill_ms is the call until the first new token, decode_ms from there to
// the last, tokens_per_s = (new tokens - 1) / decode seconds. `timings` is llama.cpp's own account
// (llama_perf_context: prompt_ms / prompt_n for the prefill, predicted_ms / predicted_n for the rest).
// Decoding stops after n_predict tokens or after the model's end-of-sequence token, which is kept in `ids`
// (as the PyTorch reference keeps it).
//
// No download and no build at run time: build "never" with skipDownload takes the prebuilt binary or fails.
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { getLlama, LlamaLogLevel } from 'node-llama-cpp';

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' }, 'n-predict': { type: 'string' }, threads: { type: 'string', default: '1' },
    'n-ctx': { type: 'string', default: '2048' }, 'no-warmup': { type: 'boolean', default: false },
  },
});
if (!args.model || !args['n-predict']) {
  throw new Error('usage: node llamacpp.mjs --model FILE.gguf --n-predict N [--threads T] [--no-warmup] < prompts.json');
}
const nPredict = Number(args['n-predict']), threads = Number(args.threads);
const prompts = JSON.parse(readFileSync(0, 'utf8'));

// llama.cpp's log: warnings and errors to stderr; the perf report (info level) kept for `timings`
let perf = [];
const llama = await getLlama({
  gpu: false, build: 'never', skipDownload: true, usePrebuiltBinaries: true, progressLogs: false,
  maxThreads: 0,  // no cap of node-llama-cpp's own: the context's thread count is the one llama.cpp uses
  logLevel: LlamaLogLevel.info,
  logger: (level, message) => {
    if (/ eval time =/.test(message)) perf.push(message);
    else if (level === LlamaLogLevel.warn || level === LlamaLogLevel.error) process.stderr.write(message);
  },
});
const model = await llama.loadModel({ modelPath: args.model, gpuLayers: 0 });
const context = await model.createContext({
  contextSize: Number(args['n-ctx']), sequences: 1, threads, flashAttention: false, performanceTracking: true,
});
const sequence = context.getSequence();
const eos = model.tokens.eos;

/** llama.cpp's perf report since the last one (printTimings logs it and resets the counters). */
async function timings() {
  perf = [];
  await context.printTimings();
  await new Promise((resolve) => setTimeout(resolve, 0));  // the log callback may land a tick later
  const read = (re) => {
    const m = perf.join('\n').match(re);  // "...eval time =  70.89 ms /  7 runs (...)"
    return m ? [Number(m[1]), Number(m[2])] : [null, null];
  };
  const [prompt_ms, prompt_n] = read(/prompt eval time =\s*([\d.]+) ms \/\s*(\d+)/);
  const [predicted_ms, predicted_n] = read(/:\s+eval time =\s*([\d.]+) ms \/\s*(\d+)/);
  return { prompt_ms, prompt_n, predicted_ms, predicted_n };
}

async function generate(promptIds, n) {
  await sequence.clearHistory();  // every prompt prefilled in full: nothing kept from the one before
  await timings();
  const ids = [];
  let first = null, last = null;
  const t0 = performance.now();
  if (n > 0) {
    // temperature 0: node-llama-cpp's sampler chain is llama.cpp's greedy sampler alone (no penalties given)
    for await (const token of sequence.evaluate(promptIds, { temperature: 0, yieldEogToken: true })) {
      last = performance.now();
      first ??= last;
      ids.push(token);
      if (token === eos || ids.length >= n) break;
    }
  }
  const end = performance.now();
  first ??= end; last ??= end;
  const decode_ms = last - first;
  if (sequence.nextTokenIndex < promptIds.length) {
    throw new Error(`llama.cpp holds ${sequence.nextTokenIndex} tokens where it was given ${promptIds.length}`);
  }
  return {
    ids, prompt_tokens: promptIds.length, prefill_ms: first - t0, decode_ms, total_ms: end - t0,
    tokens_per_s: ids.length > 1 && decode_ms > 0 ? (ids.length - 1) / (decode_ms / 1000) : null,
    timings: await timings(),
  };
}

const pkg = JSON.parse(readFileSync(new URL('./node_modules/node-llama-cpp/package.json', import.meta.url), 'utf8'));
const info = {
  node_llama_cpp: pkg.version,
  llama_cpp: llama.llamaCppRelease.release, llama_cpp_repo: llama.llamaCppRelease.repo,
  build: llama.buildType, gpu: llama.gpu, threads: context.idealThreads, threads_requested: threads,
  n_ctx: context.contextSize, eos, system_info: llama.systemInfo,
};
if (!args['no-warmup'] && prompts.length) await generate(prompts[0], 4);
const results = [];
for (const p of prompts) results.push(await generate(p, nPredict));
process.stdout.write(JSON.stringify({ llamacpp_info: info, results }) + '\n');
await context.dispose();
await model.dispose();
await llama.dispose();
