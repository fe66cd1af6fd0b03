// The task APIs' decoding, off the page's main thread: a module Worker that ai.mjs starts once per page. It
// runs the page's own decode loop (generate.mjs over onnx_backend.mjs, speculative with the MTP head) on
// the sessions of sessions.mjs, one decode at a time, and streams each step's accepted tokens back as text.
//
// Messages in (each with an `id` the replies carry):
//   {type: 'availability', backend}  -> {value: 'available' | 'downloadable' | 'downloading'}
//   {type: 'load', backend}          -> {type: 'progress', loaded, total} (model bytes) ..., then {value: info}
//   {type: 'count', prompt}          -> {value: the prompt's token count}
//   {type: 'generate', prompt, maxNewTokens} -> {type: 'chunk', text, ids} per step, then {value: result}
//   {type: 'abort', target}          stops the generation `target` after the step that is running
// A prompt is {task, text} (the task's format, tasks.mjs) or {chat: [{role, content}, ..]} (the chat
// template's turns, manifest.chat). Errors come back as {error: {name, message}}.

import { PageError } from './errors.mjs';
import { decode } from './generate.mjs';
import { OnnxBackend } from './onnx_backend.mjs';
import { chooseBackend, chooseThreads, runtimeFile, startRuntime } from './runtime.mjs';
import { fetchBytes, isCached } from './files.mjs';
import { loadModels } from './sessions.mjs';

const MODELS = new URL('models/', import.meta.url);
let models = null;       // the promise of {manifest, tokenizer, sessions, info}, once a load started
let loading = false;     // a load is downloading or opening graphs now
let chain = Promise.resolve();  // one decode at a time, in the order asked
const controllers = new Map();  // generation id -> its AbortController

/** The graphs a task ('chat' for LanguageModel) decodes with: the base and the head graph of the manifest's
 * default k, the same for every task (a feature's adapter is inputs of the base graph: sessions.adapterFeeds). */
const graphsFor = (manifest, task = 'chat') => ['base', manifest.head.by_k[manifest.defaults.k]];

/** The precision loadModels would open for this backend choice, among the site's. */
function precisionOf(manifest, choice) {
  const built = Object.keys(manifest.precisions);
  return [choice.q4 ? ['q4', choice.precision] : choice.precision].flat().find((p) => built.includes(p)) ?? built[0];
}

/** Whether every file the task APIs need is in Cache Storage: the graphs, their weights (or the packed form
 * the page downloads instead), the tokenizer and the WebAssembly runtime. */
async function availability(backend) {
  if (loading) return 'downloading';
  if (models) return 'available';
  const choice = await chooseBackend(backend, null);
  await startRuntime(choice.backend);  // imports the bundle only: runtimeFile names the build in use
  const manifest = JSON.parse(new TextDecoder().decode(await fetchBytes(new URL('manifest.json', MODELS))));
  const graphs = manifest.precisions[precisionOf(manifest, choice)].graphs;
  const files = new Set([manifest.tokenizer, ...graphsFor(manifest).flatMap((g) => [graphs[g].file, ...graphs[g].weights]),
    ...Object.values(manifest.adapters?.by_task ?? {})].map((f) => manifest.files[f].packed?.file ?? f));
  const cached = await Promise.all([...files].map((f) => isCached(new URL(f, MODELS), manifest.files[f].sha256)));
  const runtime = runtimeFile(manifest);  // cached under its sha256, as fetchRuntime keeps it
  return cached.every(Boolean) && await isCached(runtime.url, runtime.sha256) ? 'available' : 'downloadable';
}

/** Loads the models once per worker, reporting the model files' bytes (0..total) as they arrive. */
function load(backend, progress) {
  models ??= (async () => {
    loading = true;
    try {
      const choice = await chooseBackend(backend, null);
      const { threads, threadsNote } = chooseThreads(null, choice.backend);
      const loaded = await loadModels(MODELS, {
        backend: choice.backend, precision: choice.q4 ? ['q4', choice.precision] : choice.precision, threads,
        open: graphsFor,
        onProgress: (n, total, file) => { if (file !== 'the WebAssembly runtime') progress(n, total); },
      });
      const { sessions } = loaded;
      // every feature's adapter comes with the models: after create() nothing is left to download (availability)
      await Promise.all(Object.keys(loaded.manifest.adapters?.by_task ?? {}).map((task) => sessions.adapterFeeds(task)));
      return { ...loaded, info: { backend: sessions.backend, precision: sessions.precision, threads, threadsNote,
        note: choice.note, contextWindow: loaded.manifest.context_length, chat: !!loaded.manifest.chat,
        tasks: Object.keys(loaded.manifest.tasks) } };
    } finally {
      loading = false;
    }
  })();
  models.catch(() => { models = null; });  // a failed load may be tried again
  return models;
}

async function loaded() {
  if (!models) throw new PageError('the models are not loaded: create() first');
  return models;
}

/** The prompt's ids: a task's format around the text, or a conversation in the chat template's turns. */
function encode({ manifest, tokenizer }, prompt) {
  if (!prompt.chat) return tokenizer.encodePrompt(prompt.task, prompt.text);
  if (!manifest.chat) throw new PageError('this model has no chat template');
  const { roles, default_system: system, generation } = manifest.chat;
  const ids = prompt.chat[0]?.role === 'system' ? [] : [...system];
  for (const { role, content } of prompt.chat) ids.push(...roles[role].prefix, ...tokenizer.encodeText(content), ...roles[role].suffix);
  return ids.concat(generation);
}

/** Text as it streams: the decoded ids less any trailing U+FFFD (a character whose bytes are not all decided
 * yet), so that every chunk is whole characters and the chunks add up to the final text. */
class TextStream {
  constructor(tokenizer) {
    this.tokenizer = tokenizer;
    this.shown = '';
  }

  next(ids, final = false) {
    const text = this.tokenizer.decode(ids);
    const whole = final ? text : text.replace(/\uFFFD+$/, '');
    if (!whole.startsWith(this.shown)) throw new Error('decoded text is not a continuation of what was streamed');
    const chunk = whole.slice(this.shown.length);
    this.shown = whole;
    return chunk;
  }
}

/** Resolves after the messages already queued for this worker (an abort) have been handled: a decode whose
 * runs resolve without giving the event loop a turn (WASM) would otherwise read its signal only at the end. */
const nextTask = () => new Promise((resolve) => {
  const channel = new MessageChannel();
  channel.port1.onmessage = () => { channel.port1.close(); resolve(); };
  channel.port2.postMessage(null);
});

/** The backend, each base pass after a turn of the event loop (see nextTask). */
function yielding(backend) {
  const verify = backend.verify.bind(backend);
  backend.verify = async (...args) => {
    await nextTask();
    return verify(...args);
  };
  return backend;
}

/** One generation, queued behind the running one; MTP at the manifest's default k, prompt lookup as its default. */
function generate(id, prompt, maxNewTokens, post) {
  const controller = new AbortController();
  controllers.set(id, controller);
  const job = chain.then(async () => {
    const m = await loaded();
    const { manifest, tokenizer, sessions } = m;
    const promptIds = encode(m, prompt);
    const k = manifest.defaults.k;
    const draftCut = manifest.draft_cut?.[sessions.backend] ?? 0;
    const adapter = await sessions.adapterFeeds(prompt.task ?? null);  // the feature's adapter (chat: the base alone)
    const backend = yielding(new OnnxBackend(sessions, { source: 'head', k, draftCut, adapter }));
    await sessions.open([...backend.graphs, ...graphsFor(manifest, prompt.task ?? 'chat')]);
    const stream = new TextStream(tokenizer);
    const t0 = performance.now();
    try {
      const out = await decode(backend, promptIds, {
        maxNewTokens, eos: manifest.eos_token_id, k, lookup: manifest.defaults.lookup, lookupSpan: manifest.lookup_span,
        draftCut, signal: controller.signal,
        onStep: (sofar) => {
          const text = stream.next(sofar.ids);
          post({ type: 'chunk', text, ids: sofar.ids.length });
        },
      });
      const text = tokenizer.decode(out.ids);
      const rest = stream.next(out.ids, true);
      if (rest) post({ type: 'chunk', text: rest, ids: out.ids.length });
      return { promptIds, ids: out.ids, text, steps: out.steps, accepted: out.accepted, stopped: out.stopped,
        start: performance.timeOrigin + t0, end: performance.timeOrigin + performance.now(),
        backend: sessions.backend, precision: sessions.precision };
    } finally {
      backend.close();
    }
  });
  chain = job.catch(() => {});
  return job.finally(() => controllers.delete(id));
}

const error = (e) => ({ name: e?.name === 'Error' || e instanceof PageError ? 'OperationError' : e?.name ?? 'OperationError',
  message: e?.message ?? String(e) });

self.onmessage = async ({ data }) => {
  const { id, type } = data;
  const post = (message) => self.postMessage({ id, ...message });
  if (type === 'abort') {
    controllers.get(data.target)?.abort();
    return;
  }
  try {
    let value;
    if (type === 'availability') value = await availability(data.backend);
    else if (type === 'load') value = (await load(data.backend, (loaded, total) => post({ type: 'progress', loaded, total }))).info;
    else if (type === 'count') value = encode(await loaded(), data.prompt).length;
    else if (type === 'generate') value = await generate(id, data.prompt, data.maxNewTokens, post);
    else throw new Error(`unknown message type ${type}`);
    post({ type: 'done', value });
  } catch (e) {
    post({ type: 'error', error: error(e) });
  }
};
