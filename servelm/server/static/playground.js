// The servelm playground: a chat tab (OpenAI chat completions, streamed) and a raw completion tab
// (streamed completions with logprobs). Plain JS, no network beyond this server: every URL is
// relative, so the page also works behind a --root-path proxy.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "servelm-playground-api-key";

const state = {
  messages: [],        // {role, content, images, reasoning, toolCalls, stats, format, note}
  pendingImages: [],   // data: URLs attached to the message being written
  controller: null,    // AbortController of the generation in flight
  reasoningParser: null,
};

// -- HTTP ------------------------------------------------------------------------------------

function headers() {
  const result = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

class ServerError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function readError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    const error = body.error || body;
    if (error.message) message = `${response.status}: ${error.message}`;
    else if (typeof body.detail === "string") message = `${response.status}: ${body.detail}`;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ServerError(response.status, message);
}

// Ask for the API key (after a 401); resolves true when one was entered.
function askForKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-input").value = $("api-key").value;
    dialog.onclose = () => {
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "ok" && key) {
        $("api-key").value = key;
        localStorage.setItem(KEY_STORAGE, key);
        resolve(true);
      } else resolve(false);
    };
    dialog.showModal();
    $("key-input").focus();
  });
}

// fetch with the API key; a 401 asks for the key once and retries.
async function call(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(path, {...options, headers: headers()});
    if (response.status === 401 && attempt === 0 && await askForKey()) continue;
    if (!response.ok) throw await readError(response);
    return response;
  }
}

// Yields the parsed JSON of each SSE "data:" event until [DONE]; an in-band error event throws.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ServerError(parsed.error.code || 500, parsed.error.message);
        yield parsed;
      }
    }
  }
}

function showError(error) {
  if (error.name === "AbortError") return;
  $("error-text").textContent = error instanceof ServerError ? `Server error ${error.message}`
    : `Error: ${error.message}`;
  $("error").hidden = false;
}

function hideError() { $("error").hidden = true; }

// -- settings --------------------------------------------------------------------------------

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function parseJsonField(id, what) {
  const raw = $(id).value.trim();
  if (!raw) return undefined;
  try { return JSON.parse(raw); } catch (error) { throw new Error(`${what} is not valid JSON: ${error.message}`); }
}

function samplingFields() {
  const body = {temperature: numberField("temperature"), top_p: numberField("top-p"),
                max_tokens: numberField("max-tokens"), seed: numberField("seed")};
  for (const key of Object.keys(body)) if (body[key] === undefined) delete body[key];
  return body;
}

function responseFormat() {
  const kind = $("response-format").value;
  if (kind === "json_object") return {type: "json_object"};
  if (kind === "json_schema") {
    const schema = parseJsonField("json-schema", "The JSON schema");
    if (!schema) throw new Error("The JSON schema box is empty");
    return {type: "json_schema", json_schema: {name: "playground", schema}};
  }
  return undefined;
}

// -- server info -----------------------------------------------------------------------------

const percent = (value) => value == null ? "–" : `${(100 * value).toFixed(0)}%`;

async function refreshServerInfo() {
  try {
    const response = await fetch("get_server_info", {headers: headers()});
    if (response.status === 401) { $("server-load").textContent = "API key needed"; return; }
    if (!response.ok) return;
    const info = await response.json();
    $("model-name").textContent = info.served_model_name || info.model || "model";
    state.reasoningParser = info.reasoning_parser || null;
    $("server-load").textContent = `running ${info.num_running ?? "–"} · queued ${info.num_waiting ?? "–"}` +
      ` · KV ${percent(info.token_usage)} · cache hits ${percent(info.cache_hit_rate)}`;
  } catch (_) {
    $("server-load").textContent = "server unreachable";
  }
}

// -- chat ------------------------------------------------------------------------------------

function statsText(stats) {
  if (!stats || stats.ttftMs == null) return "";
  const parts = [`TTFT ${stats.ttftMs.toFixed(0)} ms`];
  if (stats.tokensPerS != null) parts.push(`${stats.tokensPerS.toFixed(1)} tok/s`);
  if (stats.tokens != null) parts.push(`${stats.tokens} tokens`);
  if (stats.finishReason) parts.push(stats.finishReason);
  return parts.join(" · ");
}

function renderContent(message) {
  if (message.format === "json" && message.content) {
    let text = message.content;
    try { text = JSON.stringify(JSON.parse(text), null, 2); } catch (_) { /* still streaming */ }
    return Markdown.render("```json\n" + text + "\n```");
  }
  return Markdown.render(message.content || "");
}

function messageElement(message, index, isStreaming) {
  const element = document.createElement("div");
  element.className = `message ${message.role}` + (isStreaming ? " streaming" : "");
  element.dataset.index = index;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const bar = document.createElement("span");
  bar.className = "tools-bar";
  if (!isStreaming && !state.controller) {
    if (message.role === "user") bar.append(linkButton("Edit", "edit", () => editMessage(index)));
    if (message.role === "assistant") bar.append(linkButton("Regenerate", "regenerate", () => regenerate(index)));
  }
  role.append(bar);
  element.append(role);
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = isStreaming && !message.content;
    const summary = document.createElement("summary");
    summary.textContent = isStreaming && !message.content ? "Thinking…" : "Reasoning";
    const body = document.createElement("div");
    body.textContent = message.reasoning;
    details.append(summary, body);
    element.append(details);
  }
  if (message.images && message.images.length) {
    const images = document.createElement("div");
    images.className = "images";
    for (const url of message.images) {
      const image = document.createElement("img");
      image.className = "attached";
      image.src = url;
      image.alt = "attached image";
      images.append(image);
    }
    element.append(images);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.dataset.raw = message.content || "";
  if (message.role === "assistant") content.innerHTML = renderContent(message);
  else content.textContent = message.content;
  element.append(content);
  if (message.toolCalls && message.toolCalls.length) {
    const calls = document.createElement("div");
    calls.className = "tool-calls";
    const pre = document.createElement("pre");
    pre.textContent = message.toolCalls.map((call) =>
      `${call.function.name}(${call.function.arguments})`).join("\n");
    calls.append(pre);
    element.append(calls);
  }
  if (message.note) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = message.note;
    element.append(note);
  }
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = statsText(message.stats);
    element.append(stats);
  }
  return element;
}

function linkButton(text, name, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = `link ${name}`;
  button.textContent = text;
  button.onclick = onClick;
  return button;
}

function renderMessages() {
  const list = $("messages");
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  list.replaceChildren(...state.messages.map((message, index) =>
    messageElement(message, index, state.controller !== null && index === state.messages.length - 1)));
  if (nearBottom) list.scrollTop = list.scrollHeight;
}

// Replace only the streaming (last) message: re-rendering everything per token would be slow.
function renderLast() {
  const list = $("messages");
  const index = state.messages.length - 1;
  const fresh = messageElement(state.messages[index], index, state.controller !== null);
  const old = list.lastElementChild;
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  if (old && Number(old.dataset.index) === index) {
    const oldDetails = old.querySelector("details.reasoning");
    const freshDetails = fresh.querySelector("details.reasoning");
    if (oldDetails && freshDetails && oldDetails.dataset.touched) {
      freshDetails.open = oldDetails.open;
      freshDetails.dataset.touched = "1";
    }
    old.replaceWith(fresh);
  } else list.append(fresh);
  const details = fresh.querySelector("details.reasoning");
  if (details) details.addEventListener("toggle", () => { details.dataset.touched = "1"; });
  if (nearBottom) list.scrollTop = list.scrollHeight;
}

function setBusy(isBusy) {
  $("send").hidden = isBusy;
  $("stop").hidden = !isBusy;
  $("complete").hidden = isBusy;
  $("complete-stop").hidden = !isBusy;
  $("clear-chat").disabled = isBusy;
}

function chatRequestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({role: "system", content: system});
  for (const message of state.messages) {
    const entry = {role: message.role, content: message.content || ""};
    if (message.images && message.images.length) {  // OpenAI content parts: the images, then the text
      entry.content = message.images.map((url) => ({type: "image_url", image_url: {url}}));
      if (message.content) entry.content.push({type: "text", text: message.content});
    }
    if (message.toolCalls && message.toolCalls.length) entry.tool_calls = message.toolCalls;
    messages.push(entry);
  }
  const body = {messages, stream: true, stream_options: {include_usage: true}, ...samplingFields()};
  const format = responseFormat();
  if (format) body.response_format = format;
  const tools = parseJsonField("tools", "The tool definitions");
  if (tools) {
    if (!Array.isArray(tools)) throw new Error("The tool definitions must be a JSON list");
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

function addToolCallDeltas(message, deltas) {
  message.toolCalls = message.toolCalls || [];
  for (const delta of deltas) {
    const index = delta.index ?? message.toolCalls.length;
    const call = message.toolCalls[index] ||
      (message.toolCalls[index] = {id: delta.id, type: "function", function: {name: "", arguments: ""}});
    if (delta.id) call.id = delta.id;
    if (delta.function?.name) call.function.name += delta.function.name;
    if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
  }
}

// Stream one assistant answer to the end of state.messages.
async function generateReply() {
  hideError();
  let body;
  try { body = chatRequestBody(); } catch (error) { showError(error); return; }
  const message = {role: "assistant", content: "", reasoning: "", stats: null,
                   format: body.response_format ? "json" : "text"};
  state.messages.push(message);
  state.controller = new AbortController();
  setBusy(true);
  renderMessages();
  const startMs = performance.now();
  let firstMs = null, chunks = 0;
  const stats = () => {
    const now = performance.now();
    const result = {ttftMs: firstMs === null ? null : firstMs - startMs, tokens: message.usageTokens};
    const generated = message.usageTokens ?? chunks;
    if (firstMs !== null && generated > 1 && now > firstMs) result.tokensPerS = (generated - 1) / ((now - firstMs) / 1000);
    result.finishReason = message.finishReason;
    return result;
  };
  try {
    const response = await call("v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal});
    for await (const chunk of sseEvents(response)) {
      if (chunk.usage) message.usageTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const hasText = delta.content || delta.reasoning_content || delta.tool_calls;
        if (hasText) {
          if (firstMs === null) firstMs = performance.now();
          chunks += 1;
        }
        if (delta.content) message.content += delta.content;
        if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
        if (delta.tool_calls) addToolCallDeltas(message, delta.tool_calls);
        if (choice.finish_reason) message.finishReason = choice.finish_reason;
      }
      message.stats = stats();
      renderLast();
    }
  } catch (error) {
    if (error.name === "AbortError") message.note = "stopped";
    else { message.note = error.message; showError(error); }
  } finally {
    message.stats = stats();
    state.controller = null;
    setBusy(false);
    renderMessages();
  }
}

function sendMessage() {
  const text = $("chat-input").value;
  const images = state.pendingImages;
  if ((!text.trim() && !images.length) || state.controller) return;
  $("chat-input").value = "";
  state.pendingImages = [];
  renderAttachments();
  state.messages.push({role: "user", content: text, images});
  generateReply();
}

// -- images ----------------------------------------------------------------------------------

function renderAttachments() {
  const strip = $("attachments");
  strip.hidden = !state.pendingImages.length;
  strip.replaceChildren(...state.pendingImages.map((url, index) => {
    const figure = document.createElement("figure");
    const image = document.createElement("img");
    image.src = url;
    image.alt = "image to send";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "secondary";
    remove.textContent = "×";
    remove.title = "Remove";
    remove.onclick = () => { state.pendingImages.splice(index, 1); renderAttachments(); };
    figure.append(image, remove);
    return figure;
  }));
}

// Attach image files (picked or pasted) as data: URLs; the server checks them.
function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { state.pendingImages.push(reader.result); renderAttachments(); };
    reader.onerror = () => showError(new Error(`Could not read ${file.name}`));
    reader.readAsDataURL(file);
  }
}

function editMessage(index) {
  const element = $("messages").querySelector(`.message[data-index="${index}"]`);
  const content = element.querySelector(".content");
  const editor = document.createElement("textarea");
  editor.className = "editor";
  editor.value = state.messages[index].content;
  editor.rows = Math.min(12, editor.value.split("\n").length + 1);
  const save = linkButton("Save & submit", "save", () => {
    const images = state.messages[index].images;
    state.messages = state.messages.slice(0, index);
    state.messages.push({role: "user", content: editor.value, images});
    generateReply();
  });
  const cancel = linkButton("Cancel", "cancel", renderMessages);
  content.replaceWith(editor);
  editor.after(save, cancel);
  editor.focus();
}

function regenerate(index) {
  state.messages = state.messages.slice(0, index);
  generateReply();
}

function stopGeneration() {
  if (state.controller) state.controller.abort();
}

// -- completion tab --------------------------------------------------------------------------

function tooltipFor(span) {
  const rows = JSON.parse(span.dataset.top || "[]");
  const chosen = span.dataset.token;
  const logprob = Number(span.dataset.logprob);
  const table = rows.map(([token, value]) =>
    `<tr class="${token === chosen ? "chosen" : ""}"><td>${Markdown.escapeHtml(JSON.stringify(token))}</td>` +
    `<td>${(100 * Math.exp(value)).toFixed(2)}%</td><td>${value.toFixed(3)}</td></tr>`).join("");
  return `<div>${Markdown.escapeHtml(JSON.stringify(chosen))}: p = ${(100 * Math.exp(logprob)).toFixed(2)}%` +
    ` (logprob ${logprob.toFixed(3)})</div><table>${table}</table>`;
}

function tokenSpan(text, token, logprob, top) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  span.dataset.token = token;
  span.dataset.logprob = logprob;
  span.dataset.top = JSON.stringify(Object.entries(top || {}).sort((a, b) => b[1] - a[1]));
  const probability = Math.exp(logprob);
  span.style.background = `rgba(${Math.round(255 * (1 - probability))}, ${Math.round(200 * probability)}, 80, 0.22)`;
  span.title = `p = ${(100 * probability).toFixed(2)}%`;
  return span;
}

async function runCompletion() {
  if (state.controller) return;
  hideError();
  const output = $("completion-output");
  const prompt = $("completion-prompt").value;
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt";
  promptSpan.textContent = prompt;
  output.replaceChildren(promptSpan);
  $("completion-stats").textContent = "";
  const numLogprobs = numberField("num-logprobs") ?? 5;
  const body = {prompt, stream: true, stream_options: {include_usage: true}, logprobs: numLogprobs,
                ...samplingFields()};
  state.controller = new AbortController();
  setBusy(true);
  const startMs = performance.now();
  let firstMs = null, tokens = 0, finishReason = "";
  const showStats = () => {
    if (firstMs === null) return;
    const rate = tokens > 1 ? ` · ${((tokens - 1) / ((performance.now() - firstMs) / 1000)).toFixed(1)} tok/s` : "";
    $("completion-stats").textContent = `TTFT ${(firstMs - startMs).toFixed(0)} ms${rate} · ${tokens} tokens` +
      (finishReason ? ` · ${finishReason}` : "");
  };
  try {
    const response = await call("v1/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal});
    for await (const chunk of sseEvents(response)) {
      for (const choice of chunk.choices || []) {
        const logprobs = choice.logprobs;
        const count = logprobs ? logprobs.tokens.length : 0;
        if (choice.text || count) {
          if (firstMs === null) firstMs = performance.now();
        }
        if (count) {
          tokens += count;
          // One token per chunk (the usual case): the span shows the detokenized text, which
          // is right even where a token alone is half of a UTF-8 character.
          for (let i = 0; i < count; i++) {
            const text = count === 1 ? choice.text : logprobs.tokens[i];
            output.append(tokenSpan(text, logprobs.tokens[i], logprobs.token_logprobs[i], logprobs.top_logprobs[i]));
          }
        } else if (choice.text) output.append(document.createTextNode(choice.text));
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      showStats();
    }
  } catch (error) {
    if (error.name === "AbortError") finishReason = "stopped";
    else showError(error);
  } finally {
    showStats();
    state.controller = null;
    setBusy(false);
  }
}

function showTooltip(event) {
  const span = event.target.closest(".tok");
  const tooltip = $("tooltip");
  if (!span) { tooltip.hidden = true; return; }
  tooltip.innerHTML = tooltipFor(span);
  tooltip.hidden = false;
  tooltip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - 380)}px`;
  tooltip.style.top = `${event.clientY + 16}px`;
}

// -- wiring ----------------------------------------------------------------------------------

function switchTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  $("chat-panel").hidden = name !== "chat";
  $("completion-panel").hidden = name !== "completion";
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    refreshServerInfo();
  });
  for (const tab of document.querySelectorAll(".tab")) tab.onclick = () => switchTab(tab.dataset.tab);
  $("response-format").onchange = () => { $("schema-box").hidden = $("response-format").value !== "json_schema"; };
  $("chat-form").onsubmit = (event) => { event.preventDefault(); sendMessage(); };
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); sendMessage(); }
  });
  $("attach-image").onclick = () => $("image-input").click();
  $("image-input").onchange = () => { attachFiles($("image-input").files); $("image-input").value = ""; };
  $("chat-input").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files || [])].filter((file) => file.type.startsWith("image/"));
    if (files.length) { event.preventDefault(); attachFiles(files); }
  });
  $("stop").onclick = stopGeneration;
  $("complete-stop").onclick = stopGeneration;
  $("complete").onclick = runCompletion;
  $("clear-chat").onclick = () => { state.messages = []; renderMessages(); };
  $("error-close").onclick = hideError;
  $("completion-output").addEventListener("mousemove", showTooltip);
  $("completion-output").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  refreshServerInfo().then(() => { if ($("server-load").textContent === "API key needed") askForKey().then(refreshServerInfo); });
  setInterval(refreshServerInfo, 3000);
}

init();
