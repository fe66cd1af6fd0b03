// The demo page: loads the models, wires the controls, streams tokens as they are decided, and exposes
// window.frozenMTP (CONTRACT.md) for tests and outside checks. User and model text only ever reaches the
// page through textContent, never innerHTML.

import { DeviceLostError, PageError, Runtime, chooseBackend, choosePrecision } from './mtp.mjs';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const MODES = { ar: 'plain', mtp: 'MTP', drafter: 'drafter' };

function showError(e) {
  const box = $('message');
  box.textContent = e instanceof PageError ? e.message : `Unexpected error: ${e?.message || e}`;
  box.hidden = false;
}

function clearError() {
  $('message').hidden = true;
}

function mb(bytes) {
  return `${(bytes / 1e6).toFixed(1)} MB`;
}

// ---------------------------------------------------------------- loading

/**
 * Loads the models for a backend choice; the runtime falls back to WASM if its GPU device is lost.
 * `since`: when the load started (the first counts from the page's start).
 */
async function load(choice, since = 0) {
  $('backend').textContent = choice.backend === 'webgpu' ? 'WebGPU' : 'WASM';
  $('adapter').textContent = choice.adapter ? `${choice.note}: ${choice.adapter}` : choice.note;
  const runtime = await Runtime.load(new URL('models/', location.href), {
    backend: choice.backend,
    precision: choice.precision,
    open: (manifest) => ['base', manifest.head.by_k[$('k').value]],  // the rest open when first used
    onProgress(loaded, total, file) {
      $('progress').hidden = loaded >= total;
      $('progress').max = total;
      $('progress').value = loaded;
      $('progress-text').textContent = loaded >= total ? `Loaded ${file} (${mb(total)}).`
        : `Downloading ${file}: ${mb(loaded)} of ${mb(total)}`;
    },
  });
  const loadMs = performance.now() - since;
  const precisionNote = runtime.precision === choice.precision ? choice.precisionNote
    : `${runtime.precision}: this site has no ${choice.precision} models`;
  $('backend').textContent += ` · ${runtime.precision}`;
  $('precision').textContent = `· ${precisionNote}`;
  const hasDrafter = Boolean(runtime.manifest.graphs.drafter);
  $('mode').querySelector('option[value=drafter]').disabled = !hasDrafter;
  $('compare').textContent = hasDrafter ? 'Compare plain, MTP, drafter' : 'Compare plain and MTP';
  $('progress').hidden = true;
  $('progress-text').textContent = `Models ready in ${(loadMs / 1000).toFixed(1)} s.`;
  for (const id of ['generate', 'compare']) $(id).disabled = false;
  runtime.onLost = (info) => {
    const why = `the GPU device was lost (${info.reason}: ${info.message})`;
    $('progress-text').textContent = `${why[0].toUpperCase()}${why.slice(1)}: reloading the models on WASM…`;
    // after the run in flight has failed: releasing sessions or creating others while onnxruntime-web's
    // WebAssembly is suspended inside a run would re-enter it
    current = runtime.queue.then(() => runtime.close())
      .then(() => load({ backend: 'wasm', adapter: null, note: `WASM: ${why}`, ...choosePrecision(null, 'wasm', false) },
        performance.now()));
    current.catch(onLoadFailure);
  };
  return { runtime, info: { backend: runtime.backend, adapter: choice.adapter, note: choice.note, kMax: runtime.kMax,
    precision: runtime.precision, precisionNote, modes: Object.keys(MODES).filter((m) => m !== 'drafter' || hasDrafter),
    contextLength: runtime.context, loadMs } };
}

function onLoadFailure(e) {
  $('progress').hidden = true;
  $('progress-text').textContent = 'The models could not be loaded.';
  showError(e);
}

// the promise of the models in use, {runtime, info}: replaced when the page falls back to WASM
let current = chooseBackend(params.get('backend'), params.get('precision')).then((choice) => load(choice));
const ready = current;
ready.catch(onLoadFailure);

// ---------------------------------------------------------------- generation (one at a time)

let chain = Promise.resolve();
let controller = null;

/**
 * One generation, queued behind any running one so that two decodes never run at once.
 * @returns {Promise<{promptIds, ids, text, steps, accepted, ms, firstTokenMs, backend, mode, k, task, stopped, trace?}>}
 */
function generate({ prompt, task = 'continue', mode = 'mtp', k = 4, maxNewTokens = 32, trace = false, onStep, signal } = {}) {
  const job = chain.then(async () => {
    const { runtime } = await current;
    if (!(mode in MODES)) throw new PageError(`unknown mode "${mode}": choose ar, mtp or drafter`);
    if (mode !== 'ar' && !(Number.isInteger(k) && k >= 1 && k <= runtime.kMax)) {
      throw new PageError(`k must be a whole number from 1 to ${runtime.kMax}, got ${k}`);
    }
    const promptIds = runtime.encodePrompt(task, prompt);
    // open (download) the graphs this mode needs before the clock starts
    await runtime.openAll(mode === 'ar' ? ['base'] : ['base', mode === 'drafter' ? 'drafter' : runtime.headGraph(k)]);
    runtime.trace = trace ? [] : null;
    const t0 = performance.now();
    let firstTokenMs = null;
    let out;
    try {
      out = await runtime.decode(promptIds, {
        maxNewTokens, k: mode === 'ar' ? 0 : k, source: mode === 'drafter' ? 'drafter' : 'head', signal,
        onStep(decided, sofar) {
          firstTokenMs ??= performance.now() - t0;
          onStep?.(decided, sofar, performance.now() - t0);
        },
      });
    } catch (e) {
      if (e instanceof DeviceLostError) {
        throw new DeviceLostError(`${e.message} during this generation: the page is reloading the models on WASM; ` +
          'generate again');
      }
      throw e;
    }
    const ms = performance.now() - t0;
    const result = { promptIds, ids: out.ids, text: runtime.decodeText(out.ids), steps: out.steps, accepted: out.accepted,
      ms, firstTokenMs, backend: runtime.backend, precision: runtime.precision, mode, k: mode === 'ar' ? 0 : k, task, stopped: out.stopped };
    if (trace) result.trace = runtime.trace;
    runtime.trace = null;
    return result;
  });
  chain = job.catch(() => {});
  return job;
}

window.frozenMTP = {
  ready: ready.then(({ info }) => info),
  /** The models in use now (after a fallback, not those `ready` reported), and the GPU tensors they hold. */
  info: async () => {
    const { runtime, info } = await current;
    return { ...info, liveGpuTensors: runtime.gpuTensors.size };
  },
  generate: (options) => generate(options),
  /** The ids Python's encode_text gives for text (tokenizer parity tests). */
  encodeText: async (text) => (await ready).runtime.encodeText(text),
};

// ---------------------------------------------------------------- the page's controls

const task = () => document.querySelector('input[name=task]:checked').value;

for (const radio of document.querySelectorAll('input[name=task]')) {
  radio.addEventListener('change', () => {
    for (const list of document.querySelectorAll('.example-list')) list.hidden = list.dataset.task !== task();
    const first = document.querySelector(`.example-list[data-task="${task()}"] .example`);
    if (first) $('prompt').value = first.dataset.text;
  });
}
for (const button of document.querySelectorAll('.example')) {
  button.addEventListener('click', () => { $('prompt').value = button.dataset.text; });
}
$('k').addEventListener('input', () => { $('k-value').textContent = $('k').value; });
$('mode').addEventListener('change', () => { $('k').disabled = $('mode').value === 'ar'; });

/** Streams decided tokens into the output, each marked by how it came; text is decoded incrementally. */
class Stream {
  constructor(runtime, element) {
    this.runtime = runtime;
    this.element = element;
    this.ids = [];
    this.shown = 0;  // characters of the decoded text already shown
    element.replaceChildren();
  }

  push(decided) {
    for (const { id, drafted } of decided) {
      this.ids.push(id);
      const text = this.runtime.decodeText(this.ids).replace(/\uFFFD+$/, '');  // hold back a partial character
      const span = document.createElement('span');
      span.className = `tok ${drafted ? 'drafted' : 'own'}`;
      span.textContent = text.slice(this.shown);
      this.shown = Math.max(this.shown, text.length);
      this.element.append(span);
    }
  }

  finish(text) {
    if (text.length > this.shown) this.element.append(text.slice(this.shown));
  }
}

function showFigures(result, ms) {
  const steps = result.steps;
  const tokens = result.ids.length;
  $('tps').textContent = ms > 0 ? (tokens / (ms / 1000)).toFixed(1) : '–';
  $('tau').textContent = steps ? (tokens / steps).toFixed(2) : '–';
  $('steps').textContent = String(steps);
  $('ntok').textContent = String(tokens);
  const bars = $('bars');
  bars.replaceChildren();
  const k = result.k || 0;
  for (let i = 1; i <= k; i += 1) {
    const share = steps ? result.accepted.filter((n) => n >= i).length / steps : 0;
    const bar = document.createElement('div');
    bar.className = 'bar';
    const fill = document.createElement('span');
    fill.style.height = `${Math.round(share * 100)}%`;
    const label = document.createElement('small');
    label.textContent = `${i}: ${Math.round(share * 100)}%`;
    bar.append(fill, label);
    bars.append(bar);
  }
}

const STOPS = { 'max-new-tokens': 'Stopped at the new-token limit.', 'end-of-sequence': 'The model ended the text.',
  'context-window': 'Stopped: the prompt and the new tokens fill the context window.', stopped: 'Stopped.' };

function setBusy(busy) {
  $('generate').disabled = busy;
  $('compare').disabled = busy;
  $('stop').disabled = !busy;
}

async function runOnPage(mode) {
  const { runtime } = await current;
  const stream = new Stream(runtime, $('output'));
  const k = Number($('k').value);
  controller = new AbortController();
  const result = await generate({
    prompt: $('prompt').value, task: task(), mode, k, maxNewTokens: Number($('max-new').value), signal: controller.signal,
    onStep(decided, sofar, ms) {
      stream.push(decided);
      showFigures({ ids: sofar.ids, steps: sofar.steps, accepted: sofar.accepted, k: mode === 'ar' ? 0 : k }, ms);
    },
  });
  stream.finish(result.text);
  showFigures(result, result.ms);
  $('first').textContent = result.firstTokenMs == null ? '–' : `${Math.round(result.firstTokenMs)} ms`;
  $('stop-reason').textContent = STOPS[result.stopped];
  return result;
}

async function onGenerate() {
  clearError();
  setBusy(true);
  try {
    await runOnPage($('mode').value);
  } catch (e) {
    showError(e);
  } finally {
    setBusy(false);
  }
}

async function onCompare() {
  clearError();
  setBusy(true);
  $('comparison').hidden = false;
  const rows = $('comparison-rows');
  rows.replaceChildren();
  try {
    const results = [];
    const { info } = await current;
    for (const mode of info.modes) {
      const r = await runOnPage(mode);
      results.push(r);
      const tr = document.createElement('tr');
      for (const cell of [MODES[mode] + (mode !== 'ar' ? ` k=${r.k}` : ''), (r.ids.length / (r.ms / 1000)).toFixed(1),
        String(r.steps), String(Math.round(r.ms))]) {
        const td = document.createElement('td');
        td.textContent = cell;
        tr.append(td);
      }
      rows.append(tr);
    }
    const [plain, mtp, drafter] = results;
    const speed = (r) => r.ids.length / r.ms;
    const differs = results.slice(1).find((r) => r.ids.length !== plain.ids.length || r.ids.some((id, i) => id !== plain.ids[i]));
    const same = !differs;
    $('comparison-verdict').textContent = same
      ? `Identical text, ${plain.ids.length} tokens. MTP ran at ${(speed(mtp) / speed(plain)).toFixed(2)}x the plain speed` +
        (drafter ? `, the independent drafter at ${(speed(drafter) / speed(plain)).toFixed(2)}x.` : '.')
      : `The ${MODES[differs.mode]} text differs from the plain one: please report this.`;
    $('comparison-verdict').className = same ? 'same' : 'differ';
  } catch (e) {
    showError(e);
  } finally {
    setBusy(false);
  }
}

$('generate').addEventListener('click', onGenerate);
$('compare').addEventListener('click', onCompare);
$('stop').addEventListener('click', () => controller?.abort());
window.addEventListener('unhandledrejection', (event) => showError(event.reason));
