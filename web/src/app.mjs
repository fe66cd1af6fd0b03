// The demo page: loads the models, wires the controls, streams tokens as they are decided, and exposes
// window.frozenMTP (CONTRACT.md) for tests and outside checks. User and model text only ever reaches the
// page through textContent, never innerHTML.

import { DeviceLostError, PageError, listed } from './errors.mjs';
import { acceptance, decode } from './generate.mjs';
import { chooseBackend, choosePrecision, chooseThreads } from './runtime.mjs';
import { loadModels } from './sessions.mjs';
import { OnnxBackend } from './onnx_backend.mjs';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

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

/** The largest k of a mode's draft source, from the manifest. */
const kMax = (manifest, mode) => manifest[manifest.modes[mode]].k;  // the mode's draft source's

// ---------------------------------------------------------------- loading

// the WASM runtime's threads: fixed when it starts, with the first load (a fallback to WASM keeps them)
let threadChoice = null;

/**
 * Loads the models for a backend choice; the page falls back to WASM if their GPU device is lost.
 * `since`: when the load started (the first counts from the page's start).
 * @returns {Promise<{models: {manifest, tokenizer, sessions}, info: object}>}
 */
async function load(choice, since = 0) {
  $('backend').textContent = choice.backend === 'webgpu' ? 'WebGPU' : 'WASM';
  threadChoice ??= chooseThreads(params.get('threads'), choice.backend);
  const threadsNote = threadChoice.threadsNote || (choice.backend === 'wasm' ? '1 WASM thread: the runtime started for WebGPU' : '');
  $('adapter').textContent = (choice.adapter ? `${choice.note}: ${choice.adapter}` : choice.note)
    + (threadsNote ? ` · ${threadsNote}` : '');
  const loading = loadModels(new URL('models/', location.href), {
    backend: choice.backend,
    precision: choice.q4 ? ['q4', choice.precision] : choice.precision,
    threads: threadChoice.threads,
    open: (manifest) => ['base', manifest.head.by_k[manifest.defaults.k]],  // the rest open when first used
    onProgress(loaded, total, file) {  // total 0: not known yet (a compressed download)
      const done = total > 0 && loaded >= total;
      $('progress').hidden = done;
      if (total) {
        $('progress').max = total;
        $('progress').value = loaded;
      } else {
        $('progress').removeAttribute('value');  // indeterminate
      }
      $('progress-text').textContent = done ? `Loaded ${file} (${mb(total)}).`
        : `Downloading ${file}: ${mb(loaded)}${total ? ` of ${mb(total)}` : ''}`;
    },
    onLost(info) {
      const why = `the GPU device was lost (${info.reason}: ${info.message})`;
      $('progress-text').textContent = `${why[0].toUpperCase()}${why.slice(1)}: reloading the models on WASM…`;
      // once the run in flight has failed (close waits for it): releasing sessions or creating others while
      // onnxruntime-web's WebAssembly is suspended inside a run would re-enter it
      current = loading.then(({ sessions }) => sessions.close())
        .then(() => load({ backend: 'wasm', adapter: null, note: `WASM: ${why}`, ...choosePrecision(null, 'wasm', false) },
          performance.now()));
      current.catch(onLoadFailure);
    },
  });
  const models = await loading;
  const { manifest, sessions } = models;
  const loadMs = performance.now() - since;
  const precisionNote = sessions.precision === choice.precision ? choice.precisionNote
    : sessions.precision === 'q4' && choice.q4 ? "q4: the GGUF's 4- and 8-bit blocks on WebGPU"
      : `${sessions.precision}: this site has no ${choice.precision} models`;
  $('backend').textContent += ` · ${sessions.precision}`;
  $('precision').textContent = `· ${precisionNote}`;
  const modes = Object.keys(manifest.modes);  // mode -> draft source, as builder/decode/loop.py's MODES
  $('compare').textContent = `Compare ${modes.map((m) => manifest.mode_labels[m]).join(', ')}`;  // contract.py's names
  $('progress').hidden = true;
  $('progress-text').textContent = `Models ready in ${(loadMs / 1000).toFixed(1)} s.`;
  for (const id of ['generate', 'compare']) $(id).disabled = false;
  return { models, info: { backend: sessions.backend, adapter: choice.adapter, note: choice.note, modes,
    kMax: kMax(manifest, 'mtp'), defaults: manifest.defaults, precision: sessions.precision, precisionNote,
    contextLength: manifest.context_length, threads: threadChoice.threads, threadsNote,
    loadMs } };
}

function onLoadFailure(e) {
  $('progress').hidden = true;
  $('progress-text').textContent = 'The models could not be loaded.';
  showError(e);
}

/**
 * Makes the page cross-origin isolated where the host did not (WASM threads need it): registers
 * coi-sw.js, which adds the headers, and reloads once it controls the page. Resolves when the page may
 * load the models as it is: isolated, or not isolatable here (no service workers, ?isolate=no, or a
 * reload that did not isolate it: then one thread).
 */
async function isolate() {
  if (globalThis.crossOriginIsolated || !navigator.serviceWorker || params.get('isolate') === 'no') return;
  const tried = sessionStorage.getItem('coi-reload') === location.href;
  sessionStorage.removeItem('coi-reload');
  if (tried) return;
  try {
    await navigator.serviceWorker.register('coi-sw.js');
    await navigator.serviceWorker.ready;
  } catch {
    return;  // e.g. storage disabled: carry on with one thread
  }
  sessionStorage.setItem('coi-reload', location.href);
  location.reload();
  await new Promise(() => {});  // the page is going away
}

// the promise of the models in use, {models, info}: replaced when the page falls back to WASM
let current = isolate().then(() => chooseBackend(params.get('backend'), params.get('precision')))
  .then((choice) => load(choice));
const ready = current;
ready.catch(onLoadFailure);

// ---------------------------------------------------------------- generation (one at a time)

let chain = Promise.resolve();
let controller = null;

/**
 * One generation, queued behind any running one so that two decodes never run at once. mode, k, lookup (prompt
 * lookup before the mode's draft source: generate.mjs) and maxNewTokens default to the manifest's `defaults`;
 * trace: true returns every graph run's inputs and outputs.
 * onStep(sofar, ms) sees the decode after every step; an aborted signal stops it at the next step.
 * draftCut: the drafts a step verifies stop where the running product of the head's confidences falls below it
 * (generate.mjs's cutDrafts; default the manifest's draft_cut for this execution provider).
 * @returns {Promise<{promptIds, ids, text, steps, accepted, lookups, verified, lookup, draftCut, ms, prefillMs, firstTokenMs, backend, precision, mode, k, task,
 *   stopped, trace?}>}
 */
function generate({ prompt, task = 'continue', mode, k, lookup, draftCut, maxNewTokens, trace = false, onStep, signal } = {}) {
  const job = chain.then(async () => {
    const { models: { manifest, tokenizer, sessions } } = await current;
    mode ??= manifest.defaults.mode;
    k ??= manifest.defaults.k;
    lookup ??= manifest.defaults.lookup;
    maxNewTokens ??= manifest.defaults.max_new_tokens;
    draftCut ??= manifest.draft_cut?.[sessions.backend] ?? 0;  // by execution provider (loop.py's DRAFT_CUT)
    if (!(mode in manifest.modes)) {
      throw new PageError(`unknown mode "${mode}": choose ${listed(Object.keys(manifest.modes))}`);
    }
    if (typeof lookup !== 'boolean') throw new PageError(`lookup must be true or false, got ${lookup}`);
    if (!(typeof draftCut === 'number' && draftCut >= 0 && draftCut < 1)) {
      throw new PageError(`draftCut must be a number from 0 (no cut) up to 1, got ${draftCut}`);
    }
    if (manifest.modes[mode] && !(Number.isInteger(k) && k >= 1 && k <= kMax(manifest, mode))) {
      throw new PageError(`k must be a whole number from 1 to ${kMax(manifest, mode)}, got ${k}`);
    }
    const promptIds = tokenizer.encodePrompt(task, prompt);
    const source = manifest.modes[mode];
    const adapter = await sessions.adapterFeeds(task);  // the feature's production model: base + its adapter
    const backend = new OnnxBackend(sessions, { source, k, draftCut, adapter, trace: trace ? [] : null });
    await sessions.open(backend.graphs);  // open (download) the graphs this mode needs before the clock starts
    const t0 = performance.now();
    let firstTokenMs = null;
    let out, ms;
    try {
      out = await decode(backend, promptIds, {
        maxNewTokens, eos: manifest.eos_token_id, k: source ? k : 0, lookup, lookupSpan: manifest.lookup_span, draftCut, signal,
        onStep(sofar) {
          firstTokenMs ??= performance.now() - t0;
          onStep?.(sofar, performance.now() - t0);
        },
      });
      ms = performance.now() - t0;
    } catch (e) {
      if (e instanceof DeviceLostError) {
        throw new DeviceLostError(`${e.message} during this generation: the page is reloading the models on WASM; ` +
          'generate again');
      }
      throw e;
    } finally {
      backend.close();
    }
    return { promptIds, ids: out.ids, text: tokenizer.decode(out.ids), steps: out.steps, accepted: out.accepted,
      lookups: out.lookups, verified: out.verified, lookup: !!source && lookup, draftCut: source === 'head' ? draftCut : 0, ms, prefillMs: out.prefillMs, firstTokenMs, backend: sessions.backend, precision: sessions.precision, mode,
      k: source ? k : 0, task, stopped: out.stopped, ...(trace ? { trace: backend.trace } : {}) };
  });
  chain = job.catch(() => {});
  return job;
}

window.frozenMTP = {
  ready: ready.then(({ info }) => info),
  /** The models in use now (after a fallback, not those `ready` reported), and the GPU tensors they hold. */
  info: async () => {
    const { models, info } = await current;
    return { ...info, liveGpuTensors: models.sessions.gpuTensors.size };
  },
  generate: (options) => generate(options),
  /** The ids Python's encode_text gives for text (tokenizer parity tests). */
  encodeText: async (text) => (await ready).models.tokenizer.encodeText(text),
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
$('mode').addEventListener('change', async () => {
  const { manifest } = (await current).models;
  $('k').disabled = $('lookup').disabled = !manifest.modes[$('mode').value];  // a mode without a draft source has no k
  if (!$('k').disabled) $('k').max = kMax(manifest, $('mode').value);  // the template's max is the head's
  $('k-value').textContent = $('k').value;
});

/** Streams decided tokens into the output, each marked by how it came; text is decoded incrementally. */
class Stream {
  constructor(tokenizer, element) {
    this.tokenizer = tokenizer;
    this.element = element;
    this.ids = [];
    this.shown = 0;  // characters of the decoded text already shown
    element.replaceChildren();
  }

  /** Shows the tokens the last step decided: its accepted drafts (the head's or the drafter's, or copied by prompt
   * lookup), then the base's own token. */
  push(sofar) {
    const accepted = sofar.accepted.at(-1) ?? 0;
    const drafted = sofar.lookups.at(-1) ? 'drafted copied' : 'drafted';
    for (const [i, id] of sofar.ids.slice(this.ids.length).entries()) {
      this.ids.push(id);
      const text = this.tokenizer.decode(this.ids).replace(/\uFFFD+$/, '');  // hold back a partial character
      const span = document.createElement('span');
      span.className = `tok ${i < accepted ? drafted : 'own'}`;
      span.textContent = text.slice(this.shown);
      this.shown = Math.max(this.shown, text.length);
      this.element.append(span);
    }
  }

  finish(text) {
    if (text.length > this.shown) this.element.append(text.slice(this.shown));
  }
}

function showFigures({ ids, steps, accepted, lookups, verified, k }, ms) {
  const [tau, byPosition] = acceptance(accepted, k);
  const copied = lookups.filter(Boolean).length;
  $('lookups').textContent = accepted.length ? `${copied} of ${steps}` : '–';
  $('tps').textContent = ms > 0 ? (ids.length / (ms / 1000)).toFixed(1) : '–';
  $('tau').textContent = steps ? tau.toFixed(2) : '–';
  $('steps').textContent = String(steps);
  $('checked').textContent = accepted.length ? (verified.reduce((sum, v) => sum + v - 1, 0) / steps).toFixed(2) : '–';
  $('ntok').textContent = String(ids.length);
  $('bars').replaceChildren(...byPosition.map((share, i) => {
    const bar = document.createElement('div');
    bar.className = 'bar';
    const fill = document.createElement('span');
    fill.style.height = `${Math.round(share * 100)}%`;
    const label = document.createElement('small');
    label.textContent = `${i + 1}: ${Math.round(share * 100)}%`;
    bar.append(fill, label);
    return bar;
  }));
}

const STOPS = { 'max-new-tokens': 'Stopped at the new-token limit.', 'end-of-sequence': 'The model ended the text.',
  'context-window': 'Stopped: the prompt and the new tokens fill the context window.', stopped: 'Stopped.' };

function setBusy(busy) {
  $('generate').disabled = busy;
  $('compare').disabled = busy;
  $('stop').disabled = !busy;
}

async function runOnPage(mode) {
  const { models } = await current;
  const stream = new Stream(models.tokenizer, $('output'));
  const k = models.manifest.modes[mode] ? Math.min(Number($('k').value), kMax(models.manifest, mode)) : 0;
  controller = new AbortController();
  const result = await generate({
    prompt: $('prompt').value, task: task(), mode, k, lookup: $('lookup').checked, maxNewTokens: Number($('max-new').value),
    signal: controller.signal,
    onStep(sofar, ms) {
      stream.push(sofar);
      showFigures({ ...sofar, k }, ms);
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

const COMPARE_ROUNDS = 3;
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const range = (xs, f) => `${f(Math.min(...xs))}-${f(Math.max(...xs))}`;

/**
 * Compare: every mode on the same prompt, timed so that a second click gives the same verdict. A warm-up
 * run of each mode first (sessions opened, kernels compiled: nothing cold is timed), then
 * COMPARE_ROUNDS rounds, each running every mode in a rotated order (no mode always first); the table
 * shows each mode's median speed with its min-max and, as the verdict, the median of its per-round ratios to plain.
 */
async function onCompare() {
  clearError();
  setBusy(true);
  $('comparison').hidden = false;
  const rows = $('comparison-rows');
  rows.replaceChildren();
  $('comparison-verdict').className = '';
  try {
    const { info, models } = await current;
    const modes = info.modes;
    const label = models.manifest.mode_labels;
    $('comparison-verdict').textContent = 'Warming up…';
    for (const mode of modes) {
      const k = models.manifest.modes[mode] ? Math.min(Number($('k').value), kMax(models.manifest, mode)) : 0;
      await generate({ prompt: $('prompt').value, task: task(), mode, k, lookup: $('lookup').checked, maxNewTokens: 4 });
    }
    const runs = Object.fromEntries(modes.map((m) => [m, []]));
    for (let round = 0; round < COMPARE_ROUNDS; round += 1) {
      for (let i = 0; i < modes.length; i += 1) {
        const mode = modes[(round + i) % modes.length];
        $('comparison-verdict').textContent = `Round ${round + 1} of ${COMPARE_ROUNDS}: ${label[mode]}…`;
        runs[mode].push(await runOnPage(mode));
      }
    }
    const speed = (r) => r.ids.length / (r.ms / 1000);
    // once the prompt is read: the prefill is the same base pass in every mode, so speculation cannot shorten it
    const streaming = (r) => r.ids.length / ((r.ms - r.prefillMs) / 1000);
    const plain = runs.ar;
    // each round's ratio to that round's plain run (the machine's speed drifts between rounds; within one
    // round the modes ran back to back): the table's last column and the verdict quote the same figure
    const ratio = (mode, f = speed) => {
      const xs = runs[mode].map((r, i) => f(r) / f(plain[i]));
      return `${median(xs).toFixed(2)}x (${range(xs, (x) => x.toFixed(2))})`;
    };
    for (const mode of modes) {
      const rs = runs[mode];
      const tr = document.createElement('tr');
      for (const cell of [label[mode] + (mode !== 'ar' ? ` k=${rs[0].k}` : ''),
        `${median(rs.map(speed)).toFixed(1)} (${range(rs.map(speed), (x) => x.toFixed(0))})`,
        String(rs[0].steps), mode === 'ar' ? '1x' : ratio(mode)]) {
        const td = document.createElement('td');
        td.textContent = cell;
        tr.append(td);
      }
      rows.append(tr);
    }
    const all = modes.flatMap((m) => runs[m]);
    const differs = all.find((r) => r.ids.length !== plain[0].ids.length || r.ids.some((id, i) => id !== plain[0].ids[i]));
    $('comparison-verdict').textContent = differs
      ? `The ${label[differs.mode]} text differs from the plain one: please report this.`
      : `Identical text, ${plain[0].ids.length} tokens. Median of ${COMPARE_ROUNDS} interleaved rounds after a warm-up: `
        + `MTP ran at ${ratio('mtp')} the plain speed`
        + (runs.drafter ? `, the independent drafter at ${ratio('drafter')}` : '')
        + `. Once the prompt was read (${Math.round(median(plain.map((r) => r.prefillMs)))} ms, the same in every mode), `
        + `MTP streamed at ${ratio('mtp', streaming)}` + (runs.drafter ? `, the drafter at ${ratio('drafter', streaming)}.` : '.');
    $('comparison-verdict').className = differs ? 'differ' : 'same';
  } catch (e) {
    $('comparison-verdict').textContent = '';
    showError(e);
  } finally {
    setBusy(false);
  }
}

$('generate').addEventListener('click', onGenerate);
$('compare').addEventListener('click', onCompare);
$('stop').addEventListener('click', () => controller?.abort());
window.addEventListener('unhandledrejection', (event) => showError(event.reason));
