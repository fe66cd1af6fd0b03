// The page's two kinds of error, shared by its modules.

/** An error a visitor can act on; `message` is one plain sentence (builder/data/tasks.py's PromptError and kin). */
export class PageError extends Error {}

/** The WebGPU device was lost (driver reset, GPU process crash, device destroyed): its sessions are gone. */
export class DeviceLostError extends PageError {}

/** "a, b or c": the choices an error names. */
export const listed = (names) => (names.length > 1 ? `${names.slice(0, -1).join(', ')} or ${names.at(-1)}` : names[0]);
