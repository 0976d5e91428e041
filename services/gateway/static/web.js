// The gateway's pages: the run page's reward curve and figures, the trace page's token layer
// and live reload. Plain script, no build step and no dependencies: it reads the JSON API with
// the page's own credentials (the browser's headers), and the page's data-* attributes.
"use strict";

(function () {
  const body = document.body;
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f6feb", "#d9480f", "#2f9e44", "#9c36b5", "#e8590c", "#0c8599", "#c2255c"];
  const MAX_STEPS = 1000; // the metrics API's largest page

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail; } catch (_) { /* not JSON: keep the status text */ }
      throw new Error(`${url}: ${response.status} ${detail}`);
    }
    return response.json();
  }

  function showProblem(error) {
    let box = document.getElementById("problem");
    if (!box) {
      box = document.createElement("p");
      box.id = "problem";
      box.className = "error";
      document.querySelector("main").prepend(box);
    }
    box.hidden = error === null;
    if (error !== null) box.textContent = String(error.message || error);
  }

  function svg(name, attributes, text) {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    if (text !== undefined) element.textContent = text;
    return element;
  }

  const pathOf = (id) => id.split("/").map(encodeURIComponent).join("/");
  const fixed = (value, digits) => (value === undefined || value === null ? "–" : Number(value).toFixed(digits));

  // --- the run page -------------------------------------------------------------------------

  // Series to draw: the reward, each environment's where the run has several, and the points of
  // the evals its owner ran during training (the run's state: GET /v1/runs/RUN's evals).
  function seriesOf(steps, evalItems) {
    const lines = new Map([["reward", []]]);
    const evals = new Map();
    for (const step of steps) {
      for (const [key, value] of Object.entries(step.metrics)) {
        let match;
        if (key === "reward_mean") lines.get("reward").push([step.step, value]);
        else if ((match = /^env\.(.+)\.reward_mean$/.exec(key))) {
          if (!lines.has(match[1])) lines.set(match[1], []);
          lines.get(match[1]).push([step.step, value]);
        }
      }
    }
    for (const point of evalItems) {
      if (point.reward_mean === null) continue;  // every rollout of it errored: nothing to draw
      if (!evals.has(point.eval)) evals.set(point.eval, []);
      evals.get(point.eval).push([point.step, point.reward_mean, point]);
    }
    return { lines, evals };
  }

  // Axes, grid and ticks of a chart of viewBox width x height; the scale of (x0..x1, y0..y1).
  function frame(chart, { x0, x1, y0, y1, height = 260, yDigits = 2, xLabels, xName }) {
    const [width, left, right, top, bottom] = [720, 64, 12, 12, 30];
    const x = (v) => left + ((v - x0) / (x1 - x0)) * (width - left - right);
    const y = (v) => height - bottom - ((v - y0) / (y1 - y0)) * (height - top - bottom);
    chart.replaceChildren();
    chart.append(svg("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" }));
    chart.append(svg("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" }));
    for (let i = 0; i <= 4; i++) {
      const value = y0 + ((y1 - y0) * i) / 4;
      chart.append(svg("line", { x1: left, y1: y(value), x2: width - right, y2: y(value), class: "grid" }));
      chart.append(svg("text", { x: left - 6, y: y(value) + 4, "text-anchor": "end", class: "tick" }, value.toFixed(yDigits)));
    }
    for (const [value, label] of xLabels) {
      chart.append(svg("text", { x: x(value), y: height - 10, "text-anchor": "middle", class: "tick" }, label));
    }
    chart.append(svg("text", { x: (left + width) / 2, y: height - 10, "text-anchor": "middle", class: "tick" }, xName));
    return { x, y };
  }

  function legendItem(legend, name, stroke, className) {
    const item = document.createElement("span");
    item.className = className ? `legend-item ${className}` : "legend-item";
    item.style.setProperty("--color", stroke);
    item.textContent = name;
    legend.append(item);
  }

  function drawChart(chart, legend, steps, evalItems) {
    const { lines, evals } = seriesOf(steps, evalItems);
    const points = [...lines.values(), ...evals.values()].flat();
    if (points.length === 0) return;
    let [x0, x1] = [Math.min(...points.map((p) => p[0])), Math.max(...points.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...points.map((p) => p[1])), Math.max(...points.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const { x, y } = frame(chart, { x0, x1, y0, y1, xLabels: [x0, x1].map((v) => [v, String(v)]), xName: "step" });
    chart.setAttribute("data-num-steps", String(steps.length));
    legend.replaceChildren();
    let color = 0;
    for (const [name, line] of lines) {
      if (line.length === 0) continue;
      const stroke = COLORS[color++ % COLORS.length];
      chart.append(svg("polyline", {
        points: line.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
        fill: "none", stroke, "stroke-width": name === "reward" ? 2.5 : 1.5,
        "data-series": name, "data-num-points": line.length,
      }));
      legendItem(legend, name, stroke);
    }
    for (const [name, evalPoints] of evals) {
      const stroke = COLORS[color++ % COLORS.length];
      for (const [s, v, point] of evalPoints) {
        const circle = svg("circle", { cx: x(s), cy: y(v), r: 4, fill: stroke, "data-eval": name, "data-step": s });
        const title = svg("title", {});
        title.textContent = `eval ${name} at step ${s}: reward ${fixed(v, 3)}` +
          (point.reward_stderr === null ? "" : ` ± ${fixed(point.reward_stderr, 3)}`) +
          ` over ${point.num_rollouts} rollouts, ${point.num_errors} errors (eval run ${point.run})`;
        circle.append(title);
        chart.append(circle);
      }
      legendItem(legend, `eval ${name}`, stroke, "eval");
    }
  }

  function showFigures(steps) {
    if (steps.length === 0) return;
    const latest = steps[steps.length - 1];
    const m = latest.metrics;
    const set = (name, text) => { document.querySelector(`[data-figure="${name}"]`).textContent = text; };
    set("step", String(latest.step));
    set("version", String(latest.version));
    set("reward", fixed(m.reward_mean, 3));
    if (m.staleness_mean !== undefined) set("staleness", `${fixed(m.staleness_mean, 2)} / ${fixed(m.staleness_max, 0)}`);
    if (m.step_s !== undefined) set("step_s", fixed(m.step_s, 2));
    const rate = [];
    if (m.tokens_per_s !== undefined) rate.push(`${fixed(m.tokens_per_s, 0)} tokens`);
    if (m.num_rollouts !== undefined && m.step_s) rate.push(`${fixed(m.num_rollouts / m.step_s, 1)} rollouts`);
    if (rate.length) set("throughput", rate.join(", "));
    if (m.sampled_tokens_per_s !== undefined) set("sampled", `${fixed(m.sampled_tokens_per_s, 0)} tokens`);
    const reasons = {};
    for (const step of steps) {
      for (const [key, value] of Object.entries(step.metrics)) {
        if (key.startsWith("num_dropped_")) reasons[key.slice(12)] = (reasons[key.slice(12)] || 0) + value;
      }
    }
    const total = Object.values(reasons).reduce((a, b) => a + b, 0);
    if (Object.keys(reasons).length) {
      const parts = Object.entries(reasons).filter(([, n]) => n > 0).map(([why, n]) => `${why.replace("_", " ")} ${n}`);
      set("dropped", `${total}${parts.length ? ` (${parts.join(", ")})` : ""}`);
    }
  }

  function runPage() {
    const run = body.dataset.run;
    const pollMs = Number(body.dataset.pollMs) || 2000;
    const chart = document.getElementById("reward-chart");
    const legend = document.getElementById("legend");
    const badge = document.querySelector("h1 .status");
    const steps = [];
    let evalItems = [];
    let last = -1;
    function add(items) {
      const added = items.filter((step) => step.step > last);
      if (added.length === 0) return;
      steps.push(...added);
      last = added[added.length - 1].step;
      drawChart(chart, legend, steps, evalItems);
      showFigures(steps);
    }
    function setEvals(items) {
      if (JSON.stringify(items) === JSON.stringify(evalItems)) return;
      evalItems = items;
      drawChart(chart, legend, steps, evalItems);
    }
    // Polling GET /metrics: where the stream cannot be had (a proxy that buffers it, an old gateway).
    async function poll() {
      try {
        for (;;) {
          const page = await getJSON(`/v1/runs/${pathOf(run)}/metrics?since_step=${last}&limit=${MAX_STEPS}`);
          add(page.items);
          if (page.items.length < MAX_STEPS) break;
        }
        setEvals((await getJSON(`/v1/runs/${pathOf(run)}`)).evals || []);
        showProblem(null);
      } catch (error) {
        showProblem(error);
      }
      setTimeout(poll, pollMs);
    }
    // The run's stream: its steps as they are recorded, its status, its end.
    body.dataset.live = "stream";
    const stream = new EventSource(`/v1/runs/${pathOf(run)}/stream?since_step=${last}`);
    stream.addEventListener("steps", (event) => { add(JSON.parse(event.data).items); showProblem(null); });
    stream.addEventListener("evals", (event) => setEvals(JSON.parse(event.data).items));
    stream.addEventListener("status", (event) => {
      const { status, reason } = JSON.parse(event.data);
      badge.textContent = status || "unknown";
      badge.className = `status ${status || "unknown"}`;
      badge.title = reason || "";
    });
    stream.addEventListener("end", () => { stream.close(); body.dataset.live = "ended"; });
    stream.addEventListener("error", () => {
      // Closed by the server after "end" never gets here; any other error: poll instead (no reconnecting
      // EventSource, whose reconnection would send every step again).
      if (body.dataset.live !== "stream") return;
      stream.close();
      body.dataset.live = "polling";
      poll();
    });
  }

  // --- the trace page -----------------------------------------------------------------------

  // A token's text as the page shows it: model output, so set as text (never markup), with its
  // control characters, quotes and backslashes escaped as in JSON, so "\n" and "" are visible.
  const shownText = (text) => JSON.stringify(text).slice(1, -1);

  function tokenSpans(tokens) {
    const box = document.createDocumentFragment();
    const head = document.createElement("div");
    head.className = "note";
    const version = tokens.policy_version === null ? "not sampled" : `policy version ${tokens.policy_version}`;
    // Texts recorded by inference, aligned with the ids; older traces have none.
    const texts = tokens.texts && tokens.texts.length === tokens.token_ids.length ? tokens.texts : null;
    head.textContent = `${tokens.token_ids.length} tokens · ${version}${texts ? "" : " · no token texts recorded"}`;
    box.append(head);
    tokens.token_ids.forEach((id, i) => {
      const logprob = tokens.logprobs[i];
      const trained = Boolean(tokens.loss_mask[i]);
      const span = document.createElement("span");
      span.className = trained ? "tok trained" : "tok";
      const idPart = document.createElement("span");
      idPart.className = "tok-id";
      idPart.textContent = String(id);
      span.append(idPart);
      if (texts) {
        const textPart = document.createElement("span");
        textPart.className = "tok-text";
        textPart.textContent = shownText(texts[i]);
        span.append(textPart);
      }
      if (logprob !== undefined) {
        const p = Math.exp(logprob);
        span.style.background = `rgba(220, 53, 69, ${(1 - p).toFixed(3)})`;
        span.dataset.logprob = String(logprob);
      }
      span.title = `token ${id}${texts ? ` ${JSON.stringify(texts[i])}` : ""} · ` +
        `logprob ${logprob === undefined ? "–" : logprob.toFixed(4)} · ` +
        `${trained ? "trained on" : "not trained on"} · ${version}`;
      box.append(span, " ");
    });
    return box;
  }

  async function loadTokens(rollout) {
    for (const branch of document.querySelectorAll(".branch")) {
      const leaf = branch.dataset.leaf;
      const page = await getJSON(`/v1/traces/${encodeURIComponent(rollout)}/branches/${encodeURIComponent(leaf)}?tokens=true`);
      for (const node of page.nodes) {
        const box = branch.querySelector(`[data-node="${CSS.escape(node.id)}"] .tokens`);
        if (!box) continue;
        box.replaceChildren(node.tokens ? tokenSpans(node.tokens) : "no token layer recorded");
      }
      branch.dataset.tokens = "loaded";
    }
  }

  function tracePage() {
    const rollout = body.dataset.rollout;
    const toggle = document.getElementById("show-tokens");
    let loaded = null;
    toggle.addEventListener("change", async () => {
      try {
        if (toggle.checked && loaded === null) loaded = loadTokens(rollout);
        if (toggle.checked) await loaded;
        for (const box of document.querySelectorAll(".tokens")) box.hidden = !toggle.checked;
        body.dataset.tokens = toggle.checked ? "shown" : "hidden";
        showProblem(null);
      } catch (error) {
        loaded = null;
        showProblem(error);
      }
    });
    if (body.dataset.finished !== "true") {
      // A running rollout: its live stream replays the nodes shown, then brings new ones. A node that
      // extends a branch is added to it in place; one that starts a branch, or the rollout landing
      // (its rewards, its final branch), reloads the page, which the server draws.
      body.dataset.live = "following";
      const stream = new EventSource(`/v1/traces/${encodeURIComponent(rollout)}/stream`);
      stream.addEventListener("node", (event) => {
        const node = JSON.parse(event.data);
        if (document.querySelector(`[data-node="${CSS.escape(node.id)}"]`)) return;
        const branch = [...document.querySelectorAll(".branch")].find((b) => b.dataset.leaf === node.parent_id);
        if (!branch) { stream.close(); location.reload(); return; }
        branch.append(messageNode(node, toggle.checked));
        branch.dataset.leaf = node.id;
        const count = branch.querySelector(".num-messages");
        count.textContent = String(Number(count.textContent) + 1);
        loaded = null; // the token layer of the new node is not loaded yet
        if (toggle.checked) toggle.dispatchEvent(new Event("change"));
      });
      stream.addEventListener("rollout", () => { stream.close(); location.reload(); });
      stream.addEventListener("error", () => {
        stream.close();
        body.dataset.live = "lost";
        showProblem(new Error("the live trace stream was lost: reload the page to follow the rollout again"));
      });
    }
  }

  // A message of the trace as the trace page's template draws it (trace.html).
  function messageNode(node, showTokens) {
    const { role, name, tool_call_id: callId, content, tool_calls: calls } = node.message;
    const element = (tag, className, text) => {
      const made = document.createElement(tag);
      if (className) made.className = className;
      if (text !== undefined) made.textContent = text;
      return made;
    };
    const article = element("article", `message-node ${role}`);
    article.dataset.node = node.id;
    const header = element("header");
    header.append(element("span", "role", role));
    if (name) header.append(" ", element("span", "name", name));
    if (callId) header.append(" ", element("span", "note", `result of ${callId}`));
    article.append(header);
    if (content) article.append(element("pre", "content", content));
    for (const call of calls) {
      const line = element("div", "tool-call");
      line.append(element("span", "name", call.name), "(", element("code", null, call.arguments), ") ",
        element("span", "note", call.id));
      article.append(line);
    }
    const tokens = element("div", "tokens");
    tokens.hidden = !showTokens;
    article.append(tokens);
    return article;
  }

  // --- the usage page -----------------------------------------------------------------------

  // Bars by time bucket: each bucket's series stacked, from zero.
  function drawBars(chart, legend, buckets, series, yDigits) {
    const totals = buckets.map((b) => series.reduce((sum, [key]) => sum + b[key], 0));
    const top = Math.max(...totals) || 1;
    const n = buckets.length;
    const day = (i) => buckets[Math.min(i, n - 1)].start.slice(0, 16).replace("T", " ");
    const { x, y } = frame(chart, {
      x0: 0, x1: n, y0: 0, y1: top, height: 220, yDigits,
      xLabels: [[0, day(0)], [n, n > 1 ? day(n - 1) : ""]], xName: "UTC",
    });
    chart.setAttribute("data-num-buckets", String(n));
    legend.replaceChildren();
    series.forEach(([, name], i) => legendItem(legend, name, COLORS[i % COLORS.length]));
    buckets.forEach((bucket, i) => {
      let base = 0;
      series.forEach(([key, name], s) => {
        const value = bucket[key];
        if (!value) return;
        const rect = svg("rect", {
          x: x(i) + 0.5, width: Math.max(x(i + 1) - x(i) - 1, 0.5), y: y(base + value), height: y(base) - y(base + value),
          fill: COLORS[s % COLORS.length], "data-series": key, "data-value": value, "data-start": bucket.start,
        });
        rect.append(svg("title", {}, `${bucket.start} · ${name} ${fixed(value, yDigits)}`));
        chart.append(rect);
        base += value;
      });
    });
  }

  function usagePage() {
    const report = JSON.parse(document.getElementById("usage-data").textContent);
    const all = report.items.map((b) => ({ ...b, trained: b.trained_tokens + b.sft_tokens }));
    // From the first bucket with any usage on (the range's first without it): a tenant that began
    // today sees today across the chart, not a sliver at the end of an empty week.
    const used = (b) => b.prompt_tokens + b.sampled_tokens + b.trained + b.cost > 0;
    const first = all.findIndex(used);
    const buckets = first > 0 ? all.slice(first) : all;
    drawBars(document.getElementById("tokens-chart"), document.getElementById("tokens-legend"), buckets,
      [["prompt_tokens", "prompt"], ["sampled_tokens", "sampled"], ["trained", "trained"]], 0);
    drawBars(document.getElementById("cost-chart"), document.getElementById("cost-legend"), buckets,
      [["cost", `cost (${report.prices.currency})`]], 4);
  }

  // --- the run list: stop, pause, resume --------------------------------------------------

  function runsPage() {
    for (const button of document.querySelectorAll("#runs button.run-action")) {
      button.addEventListener("click", async () => {
        const run = button.closest("tr").dataset.run;
        const action = button.dataset.action;
        button.disabled = true;
        try {
          const response = await fetch(`/v1/runs/${pathOf(run)}/${action}`, {
            method: "POST", headers: { Accept: "application/json" },
          });
          if (!response.ok) {
            let detail = response.statusText;
            try { detail = (await response.json()).detail; } catch (_) { /* not JSON: keep the status text */ }
            throw new Error(`${action} ${run}: ${response.status} ${detail}`);
          }
          window.location.reload();
        } catch (error) {
          showProblem(error);
          button.disabled = false;
        }
      });
    }
  }

  if (body.dataset.page === "runs") runsPage();
  if (body.dataset.page === "run") runPage();
  if (body.dataset.page === "usage") usagePage();
  if (body.dataset.page === "trace") tracePage();
})();
