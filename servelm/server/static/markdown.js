// A small markdown renderer for the playground: headings, lists, quotes, paragraphs, fenced code
// with keyword/string/number/comment highlighting, inline code, bold, italic and http(s) links.
// Everything is HTML-escaped before any markup is added, so model output can never inject HTML.
"use strict";

const Markdown = (() => {
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => (
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

  const KEYWORDS = new Set((
    "and as assert async await break case catch class const continue def default del do elif else " +
    "enum except export extends false False finally fn for from func function if impl import in " +
    "interface is let match mut new nil None not null or package pass private protected pub public " +
    "raise return self static struct super switch this throw true True try type typeof use var " +
    "void while with yield int float str bool char double long unsigned").split(" "));

  // One regex, alternatives in priority order: comment, string, number, word.
  const CODE_TOKEN = /(#[^\n]*|\/\/[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;

  function highlight(code, language) {
    const hashComments = !/^(c|cpp|c\+\+|java|javascript|js|ts|typescript|go|rust|json|css)$/i.test(language || "");
    let out = "", last = 0, match;
    CODE_TOKEN.lastIndex = 0;
    while ((match = CODE_TOKEN.exec(code)) !== null) {
      out += escapeHtml(code.slice(last, match.index));
      const [text, comment, string, number, word] = match;
      if (comment && (hashComments || !comment.startsWith("#"))) out += `<span class="tok-com">${escapeHtml(text)}</span>`;
      else if (comment) { out += escapeHtml(text.slice(0, 1)); CODE_TOKEN.lastIndex = match.index + 1; }
      else if (string) out += `<span class="tok-str">${escapeHtml(text)}</span>`;
      else if (number) out += `<span class="tok-num">${text}</span>`;
      else if (word && KEYWORDS.has(word)) out += `<span class="tok-kw">${word}</span>`;
      else out += escapeHtml(text);
      last = CODE_TOKEN.lastIndex;
    }
    return out + escapeHtml(code.slice(last));
  }

  function inline(text) {
    const codes = [];
    let html = escapeHtml(text).replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    });
    html = html
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return html.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function blocks(text) {
    const lines = text.split("\n");
    let html = "", paragraph = [], list = null;
    const flushParagraph = () => {
      if (paragraph.length) html += `<p>${paragraph.map(inline).join("<br>")}</p>`;
      paragraph = [];
    };
    const flushList = () => {
      if (list) html += `<${list.tag}>${list.items.map((item) => `<li>${inline(item)}</li>`).join("")}</${list.tag}>`;
      list = null;
    };
    for (const line of lines) {
      let match;
      if ((match = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flushParagraph(); flushList();
        html += `<h${match[1].length}>${inline(match[2])}</h${match[1].length}>`;
      } else if ((match = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line))) {
        flushParagraph();
        const tag = /\d/.test(match[1]) ? "ol" : "ul";
        if (!list || list.tag !== tag) { flushList(); list = {tag, items: []}; }
        list.items.push(match[2]);
      } else if ((match = /^>\s?(.*)$/.exec(line))) {
        flushParagraph(); flushList();
        html += `<blockquote>${inline(match[1])}</blockquote>`;
      } else if (!line.trim()) {
        flushParagraph(); flushList();
      } else {
        flushList();
        paragraph.push(line);
      }
    }
    flushParagraph(); flushList();
    return html;
  }

  // Fenced code blocks first (an unclosed fence while streaming still renders as code).
  function render(text) {
    let html = "";
    const fence = /```([^\n`]*)\n([\s\S]*?)(```|$)/g;
    let last = 0, match;
    while ((match = fence.exec(text)) !== null) {
      html += blocks(text.slice(last, match.index));
      const language = match[1].trim();
      html += `<pre><code class="language-${escapeHtml(language)}">${highlight(match[2].replace(/\n$/, ""), language)}</code></pre>`;
      last = fence.lastIndex;
      if (match[3] === "") break;
    }
    return html + blocks(text.slice(last));
  }

  return {render, highlight, escapeHtml};
})();
