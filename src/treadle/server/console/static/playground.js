// The console's playground: a chat through POST /v1/chat/completions (streamed, with token
// logprobs), authorised by the console's login cookie: the gate hands the cookie's key on for
// this call when it carries X-Treadle-Console from a page of this origin.
(() => {
  const $ = (id) => document.getElementById(id);
  const chat = $("chat"), form = $("chat-form"), prompt = $("prompt"), errorBox = $("chat-error");
  let messages = [];

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.dataset.role = role;
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = text;
    div.append(body);
    chat.append(div);
    chat.scrollTop = chat.scrollHeight;
    return div;
  }

  function addToken(answer, token, logprob, index) {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = token;
    span.dataset.logprob = logprob;
    span.title = `logprob ${logprob.toFixed(4)}`;
    span.style.background = `rgba(47, 111, 223, ${Math.min(0.35, -logprob / 12).toFixed(3)})`;
    answer.querySelector(".body").append(span);
    const row = document.createElement("tr");
    row.innerHTML = `<td class="n">${index}</td><td><code></code></td><td class="n">${logprob.toFixed(4)}</td><td class="n">${Math.exp(logprob).toFixed(4)}</td>`;
    row.querySelector("code").textContent = JSON.stringify(token);
    $("logprobs").querySelector("tbody").append(row);
  }

  function showError(text) {
    errorBox.textContent = text;
    errorBox.hidden = false;
  }

  async function send(text) {
    errorBox.hidden = true;
    $("send").disabled = true;
    messages.push({ role: "user", content: text });
    bubble("user", text);
    const answer = bubble("assistant", "");
    answer.dataset.done = "false";
    $("logprobs").querySelector("tbody").replaceChildren();
    const body = {
      model: $("model").value,
      messages,
      temperature: Number($("temperature").value),
      top_p: Number($("top-p").value),
      max_tokens: Number($("max-tokens").value),
      stream: true,
      logprobs: true,
    };
    let content = "", n = 0;
    try {
      const res = await fetch("/v1/chat/completions", {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-Treadle-Console": "1" },
        body: JSON.stringify(body),
      });
      if (!res.ok) {
        const err = await res.json().catch(() => ({}));
        throw new Error(`${res.status}: ${(err.error && err.error.message) || err.error || res.statusText}`);
      }
      const reader = res.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6).trim();
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
            for (const choice of chunk.choices || []) {
              const tokens = (choice.logprobs && choice.logprobs.content) || [];
              if (tokens.length) {
                for (const t of tokens) addToken(answer, t.token, t.logprob, n++);
              } else if (choice.delta && choice.delta.content) {
                answer.querySelector(".body").append(choice.delta.content);
              }
              if (choice.delta && choice.delta.content) content += choice.delta.content;
            }
            answer.dataset.tokens = String(n);
          }
        }
      }
      messages.push({ role: "assistant", content });
    } catch (e) {
      messages.pop();
      answer.classList.add("failed");
      showError(String(e.message || e));
    } finally {
      answer.dataset.done = "true";
      $("send").disabled = false;
    }
  }

  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      form.requestSubmit();
    }
  });
  $("clear").addEventListener("click", () => {
    messages = [];
    chat.replaceChildren();
    $("logprobs").querySelector("tbody").replaceChildren();
  });
})();
