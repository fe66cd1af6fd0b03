// The web platform's task APIs (W3C WebML CG: writing-assistance-apis, proofreader-api, prompt-api) served by
// this site's models with MTP: a page that loads this module gets `Summarizer`, `Proofreader`, `Writer` and
// `LanguageModel` on globalThis. The decoding runs in a Worker (ai-worker.mjs), off the main thread.
//
// A browser's own API is kept where it works ("available", "downloadable" or "downloading" with no options);
// one that is missing, fails or reports "unavailable" (Debian's headless Chromium defines LanguageModel and
// Summarizer without a model service behind them) is replaced. `?ai=replace` on this module's URL or the
// page's replaces every one; `?backend=wasm|webgpu` picks the execution provider as the demo page's does.
// `globalThis.frozenMTPAI.apis` says which is in use, and why. docs/api.md maps each option to the models.

import { corrections } from './corrections.mjs';

const params = new URLSearchParams([...new URL(import.meta.url).searchParams,
  ...new URLSearchParams(globalThis.location?.search ?? '')]);
const BACKEND = params.get('backend');
// new tokens at most, by the `length` option (the tasks' answers end themselves sooner: one sentence, a short reply)
const LENGTH_TOKENS = { short: 48, medium: 96, long: 160 };

// ---------------------------------------------------------------- the worker, one per page

let worker = null;
let nextId = 1;
const pending = new Map();  // message id -> {resolve, reject, onMessage}

function startWorker() {
  worker = new Worker(new URL('./ai-worker.mjs', import.meta.url), { type: 'module' });
  worker.onmessage = ({ data }) => {
    const call = pending.get(data.id);
    if (!call) return;
    if (data.type === 'done' || data.type === 'error') pending.delete(data.id);
    if (data.type === 'done') call.resolve(data.value);
    else if (data.type === 'error') call.reject(new DOMException(data.error.message, data.error.name));
    else call.onMessage?.(data);
  };
  worker.onerror = (event) => {
    const e = new DOMException(`the task APIs' worker failed: ${event.message}`, 'OperationError');
    for (const call of pending.values()) call.reject(e);
    pending.clear();
    worker = null;
  };
}

/** Sends a message to the worker: [its id, the promise of its result]; onMessage sees progress and chunks. */
function send(type, payload = {}, onMessage = null) {
  if (!worker) startWorker();
  const id = nextId;
  nextId += 1;
  const done = new Promise((resolve, reject) => { pending.set(id, { resolve, reject, onMessage }); });
  worker.postMessage({ id, type, backend: BACKEND, ...payload });
  return [id, done];
}

const ask = (type, payload, onMessage) => send(type, payload, onMessage)[1];

/** The promise, or the signal's reason as soon as it aborts. */
function abortable(promise, signal) {
  if (!signal) return promise;
  signal.throwIfAborted();
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    promise.then(resolve, reject).finally(() => signal.removeEventListener('abort', onAbort));
  });
}

// The latest decodes' prompt and new ids, figures and times (for tests and the demo): frozenMTPAI.decodes
const decodes = [];
const log = (result) => {
  decodes.push(result);
  if (decodes.length > 32) decodes.shift();
};

// ---------------------------------------------------------------- options, availability, create

const notSupported = (message) => new DOMException(message, 'NotSupportedError');

/** A QuotaExceededError as the specs define it (with `requested` and `quota`). */
function quotaExceeded(requested, quota) {
  const message = `the input is ${requested} tokens, over the quota of ${quota}`;
  if (typeof globalThis.QuotaExceededError === 'function') return new QuotaExceededError(message, { requested, quota });
  return Object.assign(new DOMException(message, 'QuotaExceededError'), { requested, quota });
}

const english = (tags) => (tags ?? ['en']).every((t) => String(t).toLowerCase().split('-')[0] === 'en');

/** Why these options cannot be served (a message), or null: every enum is one of `choices`' and every language English. */
function unsupported(options, choices) {
  for (const [name, allowed] of Object.entries(choices)) {
    if (options[name] !== undefined && !allowed.includes(options[name])) {
      return `${name} "${options[name]}" is not supported here: only ${allowed.map((v) => `"${v}"`).join(', ')}`;
    }
  }
  for (const name of ['expectedInputLanguages', 'expectedContextLanguages']) {
    if (!english(options[name])) return `${name} ${JSON.stringify(options[name])}: the models here read English only`;
  }
  for (const name of ['outputLanguage', 'correctionExplanationLanguage']) {
    if (options[name] !== undefined && !english([options[name]])) return `${name} "${options[name]}": the models here write English only`;
  }
  return null;
}

async function availabilityOf(options, choices) {
  return unsupported(options, choices) ? 'unavailable' : ask('availability');
}

/**
 * Loads the models (once per page) for create(): `monitor` gets downloadprogress events from 0 to 1 (the model
 * files' bytes, in steps of 1/65536; 1 once they are loaded), `signal` rejects with its reason. A model not yet
 * downloaded needs the page's transient user activation (a click), as the specs say.
 */
async function load(options, choices) {
  const activated = navigator.userActivation?.isActive;  // when create() was called, before any wait
  const why = unsupported(options, choices);
  if (why) throw notSupported(why);
  options.signal?.throwIfAborted();
  const state = await abortable(ask('availability'), options.signal);
  if (state === 'downloadable' && !activated) {
    throw new DOMException('downloading the model needs a user gesture: call create() from a click handler', 'NotAllowedError');
  }
  const monitor = new EventTarget();
  options.monitor?.(monitor);
  let last = -1;
  const progress = (loaded) => {
    const step = Math.floor(loaded * 65536) / 65536;
    if (step <= last) return;
    last = step;
    monitor.dispatchEvent(new ProgressEvent('downloadprogress', { loaded: step, total: 1, lengthComputable: true }));
  };
  progress(0);
  const info = await abortable(ask('load', {}, ({ loaded, total }) => {
    if (total > 0) progress(Math.min(loaded / total, 65535 / 65536));  // 1 only once the models are ready
  }), options.signal);
  progress(1);
  return info;
}

// ---------------------------------------------------------------- the shared base: destroy, queue, decode

class TaskModel extends EventTarget {
  #destroyed = null;  // the reason, once destroyed
  #running = new Set();  // the reject functions of calls in flight
  #queue = Promise.resolve();  // this model's calls, one after the other

  constructor(options, info) {
    super();
    this.info = info;
    options.signal?.addEventListener('abort', () => this.destroy(options.signal.reason), { once: true });
  }

  /** Releases the model: calls in flight and any later call reject with `reason` (AbortError by default). */
  destroy(reason = new DOMException('the model was destroyed', 'AbortError')) {
    if (this.#destroyed) return;
    this.#destroyed = reason;
    for (const reject of this.#running) reject(reason);
  }

  /** Runs op() after this model's earlier calls; rejects at once when destroyed or when signal aborts. */
  call(op, signal) {
    if (this.#destroyed) return Promise.reject(this.#destroyed);
    if (signal?.aborted) return Promise.reject(signal.reason);
    const run = this.#queue.then(() => {
      if (this.#destroyed) throw this.#destroyed;
      signal?.throwIfAborted();
      return op();
    });
    this.#queue = run.catch(() => {});
    return new Promise((resolve, reject) => {
      this.#running.add(reject);
      const onAbort = () => reject(signal.reason);
      signal?.addEventListener('abort', onAbort, { once: true });
      run.then(resolve, reject).finally(() => {
        this.#running.delete(reject);
        signal?.removeEventListener('abort', onAbort);
      });
    });
  }

  /**
   * One decode in the worker: resolves to its result ({text, ids, promptIds, ...}); each step's new text goes to
   * onChunk. An aborted signal or destroy() stops it after the step that is running, freeing the worker.
   */
  decode(prompt, maxNewTokens, { signal, onChunk } = {}) {
    const [id, done] = send('generate', { prompt, maxNewTokens }, ({ text }) => { if (text) onChunk?.(text); });
    const stop = () => worker?.postMessage({ type: 'abort', target: id });
    signal?.addEventListener('abort', stop, { once: true });
    let onDestroy;
    const destroyed = new Promise((_, reject) => { onDestroy = reject; });
    this.#running.add(onDestroy);
    destroyed.catch(stop);
    done.then((result) => log(result), () => {});
    return Promise.race([done, destroyed]).finally(() => {
      this.#running.delete(onDestroy);
      signal?.removeEventListener('abort', stop);
    });
  }

  /** A ReadableStream of the text of run(onChunk) as it is decided. */
  stream(run, signal) {
    const controller = new AbortController();
    const both = signal ? AbortSignal.any([signal, controller.signal]) : controller.signal;
    let open = true;  // until closed, errored or cancelled: a step's text may arrive after an abort
    return new ReadableStream({
      start: (stream) => {
        run(both, (text) => { if (open) stream.enqueue(text); }).then(() => { if (open) stream.close(); }, (e) => {
          if (open) stream.error(e);
        }).finally(() => { open = false; });
      },
      cancel: (reason) => {  // the reader gave up: stop decoding
        open = false;
        controller.abort(reason);
      },
    });
  }

  async count(prompt, signal) {
    return this.call(() => ask('count', { prompt }), signal);
  }

  get contextWindow() {
    return this.info.contextWindow;
  }
}

/** A task's user text: the shared and per-call contexts, each a paragraph, before the input. */
const withContext = (input, ...contexts) => [...contexts.filter((c) => c?.trim()), input].join('\n\n');

/** Summarizer and Writer: one task, a text in and a text out. */
class TextTask extends TaskModel {
  constructor(options, info, task, defaults) {
    super(options, info);
    this.task = task;
    Object.assign(this, defaults, Object.fromEntries(Object.keys(defaults).filter((k) => options[k] !== undefined)
      .map((k) => [k, options[k]])));
    this.sharedContext = options.sharedContext ?? '';
    this.expectedInputLanguages = options.expectedInputLanguages ? Object.freeze([...options.expectedInputLanguages]) : null;
    this.expectedContextLanguages = options.expectedContextLanguages ? Object.freeze([...options.expectedContextLanguages]) : null;
    this.outputLanguage = options.outputLanguage ?? null;
    this.maxNewTokens = options.maxNewTokens ?? LENGTH_TOKENS[this.length];  // maxNewTokens: this project's extension
  }

  get inputQuota() {
    return this.contextWindow - 1;  // the prompt, its task format included, must leave room for one new token
  }

  prompt(input, context) {
    return { task: this.task, text: withContext(input, this.sharedContext, context) };
  }

  measureInputUsage(input, { signal, context } = {}) {
    return this.count(this.prompt(input, context), signal);
  }

  /** The answer's text; the empty string for an empty input (nothing to do); QuotaExceededError over the quota. */
  async run(input, { signal, context } = {}, onChunk = null) {
    return this.call(async () => {
      if (!String(input).trim()) return '';
      const prompt = this.prompt(String(input), context);
      const used = await ask('count', { prompt });
      if (used > this.inputQuota) throw quotaExceeded(used, this.inputQuota);
      return (await this.decode(prompt, this.maxNewTokens, { signal, onChunk })).text;
    }, signal);
  }

  /** As run(), with the decode's ids and figures (for tests and the demo). */
  async runDetailed(input, { signal, context } = {}) {
    return this.call(() => this.decode(this.prompt(String(input), context), this.maxNewTokens, { signal }), signal);
  }
}

const SUMMARIZER = { type: ['tldr'], format: ['plain-text', 'markdown'], length: ['short', 'medium', 'long'] };
const WRITER = { tone: ['neutral'], format: ['plain-text', 'markdown'], length: ['short', 'medium', 'long'] };
const PROOFREADER = { includeCorrectionTypes: [false], includeCorrectionExplanations: [false] };

/** writing-assistance-apis' Summarizer, on the `summarize` task ("Summarize this message in one sentence."). */
export class Summarizer extends TextTask {
  static availability(options = {}) {
    return availabilityOf(options, SUMMARIZER);
  }

  static async create(options = {}) {
    return new Summarizer(options, await load(options, SUMMARIZER));
  }

  constructor(options, info) {
    super(options, info, 'summarize', { type: 'tldr', format: 'markdown', length: 'short' });
  }

  summarize(input, options) {
    return this.run(input, options);
  }

  summarizeStreaming(input, options = {}) {
    return this.stream((signal, onChunk) => this.run(input, { ...options, signal }, onChunk), options.signal);
  }
}

/** writing-assistance-apis' Writer, on the `reply` task: write(message) writes a reply to it (a smart reply). */
export class Writer extends TextTask {
  static availability(options = {}) {
    return availabilityOf(options, WRITER);
  }

  static async create(options = {}) {
    return new Writer(options, await load(options, WRITER));
  }

  constructor(options, info) {
    super(options, info, 'reply', { tone: 'neutral', format: 'markdown', length: 'short' });
  }

  write(input, options) {
    return this.run(input, options);
  }

  writeStreaming(input, options = {}) {
    return this.stream((signal, onChunk) => this.run(input, { ...options, signal }, onChunk), options.signal);
  }
}

/** proofreader-api's Proofreader, on the `proofread` task; corrections from a character diff (corrections.mjs). */
export class Proofreader extends TaskModel {
  static availability(options = {}) {
    return availabilityOf(options, PROOFREADER);
  }

  static async create(options = {}) {
    return new Proofreader(options, await load(options, PROOFREADER));
  }

  constructor(options, info) {
    super(options, info);
    this.includeCorrectionTypes = false;
    this.includeCorrectionExplanations = false;
    this.expectedInputLanguages = options.expectedInputLanguages ? Object.freeze([...options.expectedInputLanguages]) : null;
    this.correctionExplanationLanguage = options.correctionExplanationLanguage ?? null;
    this.maxNewTokens = options.maxNewTokens ?? null;  // this project's extension; by default the input's length
  }

  /** {correctedInput, corrections}: the model's answer (its spaces at either end kept from the input), and the
   * spans of the input it changed. */
  proofread(input, { signal } = {}) {
    return this.call(async () => {
      input = String(input);
      if (!input.trim()) return { correctedInput: input, corrections: [] };
      const prompt = { task: 'proofread', text: input };
      const used = await ask('count', { prompt });
      if (used >= this.contextWindow) throw quotaExceeded(used, this.contextWindow - 1);
      // the corrected text is about as long as the input: at most as many new tokens as the prompt has
      const out = await this.decode(prompt, this.maxNewTokens ?? Math.min(used, this.contextWindow - used), { signal });
      const [, lead, , trail] = input.match(/^(\s*)([\s\S]*?)(\s*)$/);
      const correctedInput = lead + out.text.trim() + trail;
      return { correctedInput, corrections: corrections(input, correctedInput) };
    }, signal);
  }
}

// ---------------------------------------------------------------- LanguageModel (prompt-api)

/** Messages [{role, content}] of a prompt's input (a string, or messages with text content); system messages
 * only where allowSystem (the first of initialPrompts). */
function messages(input, allowSystem = false) {
  const list = typeof input === 'string' ? [{ role: 'user', content: input }] : [...input];
  return list.map((m, i) => {
    if (!['system', 'user', 'assistant'].includes(m.role)) throw new TypeError(`unknown role "${m.role}"`);
    if (m.role === 'system' && !(allowSystem && i === 0)) {
      throw new TypeError('a system message may only be the first of initialPrompts');
    }
    if (m.prefix) throw notSupported('assistant prefixes (prefix: true) are not supported here');
    const parts = typeof m.content === 'string' ? [{ type: 'text', value: m.content }] : m.content;
    if (parts.some((p) => p.type !== 'text')) throw notSupported('only text is supported here, not images or audio');
    return { role: m.role, content: parts.map((p) => p.value).join('') };
  });
}

const LANGUAGE_MODEL = {};

function checkLanguageModel(options) {
  for (const kind of ['expectedInputs', 'expectedOutputs']) {
    for (const e of options[kind] ?? []) {
      if (e.type !== 'text') throw notSupported(`${kind} of type "${e.type}": only text here`);
      if (!english(e.languages)) throw notSupported(`${kind} languages ${JSON.stringify(e.languages)}: English only here`);
    }
  }
  if (options.tools?.length) throw notSupported('tools are not supported here');
  if ((options.topK ?? 1) !== 1 || (options.temperature ?? 0) !== 0) {
    throw notSupported('decoding here is greedy: topK 1 and temperature 0 only (see LanguageModel.params())');
  }
}

/** prompt-api's LanguageModel: the chat model in its chat template; each prompt reads the whole conversation. */
export class LanguageModel extends TaskModel {
  static async availability(options = {}) {
    try {
      checkLanguageModel(options);
    } catch {
      return 'unavailable';
    }
    return ask('availability');
  }

  static async params() {
    return { defaultTopK: 1, maxTopK: 1, defaultTemperature: 0, maxTemperature: 0 };
  }

  static async create(options = {}) {
    checkLanguageModel(options);
    const history = messages(options.initialPrompts ?? [], true);
    const info = await load(options, LANGUAGE_MODEL);
    if (!info.chat) throw notSupported('this site\'s model has no chat template: LanguageModel needs one');
    const model = new LanguageModel(options, info, history);
    model.usage = await model.count({ chat: history }, options.signal);
    if (model.usage > model.contextWindow) throw quotaExceeded(model.usage, model.contextWindow);
    return model;
  }

  constructor(options, info, history) {
    super(options, info);
    this.options = options;
    this.history = history;  // the conversation so far, as messages
    this.usage = 0;
    this.topK = 1;
    this.temperature = 0;
    this.maxNewTokens = options.maxNewTokens ?? null;  // this project's extension; by default up to the window
  }

  /** Tokens the conversation so far takes of the context window (the next prompt reads them all). */
  get contextUsage() {
    return this.usage;
  }

  get inputUsage() {  // the older name
    return this.usage;
  }

  get inputQuota() {  // the older name
    return this.contextWindow;
  }

  /** Tokens the input would add to the conversation. */
  measureContextUsage(input, { signal } = {}) {
    return this.call(async () => (await ask('count', { prompt: { chat: [...this.history, ...messages(input)] } })) - this.usage,
      signal);
  }

  measureInputUsage(input, options) {  // the older name
    return this.measureContextUsage(input, options);
  }

  /** The conversation with the input, checked against the window: [its messages, its token count]. */
  async extend(input) {
    const chat = [...this.history, ...messages(input)];
    const used = await ask('count', { prompt: { chat } });
    if (used > this.contextWindow - 1) {
      this.dispatchEvent(new Event('contextoverflow'));
      throw quotaExceeded(used, this.contextWindow - 1);
    }
    return [chat, used];
  }

  /** Adds the input to the conversation without an answer. */
  append(input, { signal } = {}) {
    return this.call(async () => {
      [this.history, this.usage] = await this.extend(input);
    }, signal);
  }

  async run(input, { signal, responseConstraint } = {}, onChunk = null) {
    if (responseConstraint) throw notSupported('responseConstraint is not supported here');
    return this.call(async () => {
      const [chat, used] = await this.extend(input);
      const out = await this.decode({ chat }, this.maxNewTokens ?? this.contextWindow - used, { signal, onChunk });
      signal?.throwIfAborted();  // an aborted prompt (its decode ended after the running step) adds nothing
      this.history = [...chat, { role: 'assistant', content: out.text }];
      this.usage = await ask('count', { prompt: { chat: this.history } });
      return out.text;
    }, signal);
  }

  prompt(input, options) {
    return this.run(input, options);
  }

  promptStreaming(input, options = {}) {
    return this.stream((signal, onChunk) => this.run(input, { ...options, signal }, onChunk), options.signal);
  }

  /** A new session with this one's conversation so far. */
  clone({ signal } = {}) {
    return this.call(async () => {
      const copy = new LanguageModel({ ...this.options, signal }, this.info, [...this.history]);
      copy.usage = this.usage;
      return copy;
    }, signal);
  }
}

// ---------------------------------------------------------------- installing on globalThis

const OURS = { Summarizer, Proofreader, Writer, LanguageModel };

/** Why the browser's own API cannot serve the page, or null where it can. */
async function nativeFails(native) {
  try {
    const state = await Promise.race([native.availability(),
      new Promise((resolve) => { setTimeout(() => resolve('no answer in 3 s'), 3000); })]);
    return state === 'unavailable' || !['available', 'downloadable', 'downloading'].includes(state)
      ? `the browser's own reports "${state}"` : null;
  } catch (e) {
    return `the browser's own fails (${e.message})`;
  }
}

const apis = {};
await Promise.all(Object.entries(OURS).map(async ([name, ours]) => {
  const native = globalThis[name];
  const why = !native ? 'the browser has none' : params.get('ai') === 'replace' ? 'asked (?ai=replace)' : await nativeFails(native);
  if (why) {
    Object.defineProperty(globalThis, name, { value: ours, writable: true, configurable: true, enumerable: false });
    apis[name] = { implementation: 'frozen-mtp', why };
  } else {
    apis[name] = { implementation: 'native', why: 'the browser\'s own works' };
  }
}));

/** Which implementation serves each API, and (once a create() loaded them) the models in use. */
globalThis.frozenMTPAI = { apis, decodes, info: () => ask('load') };
