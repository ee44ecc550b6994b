// Treadle console: the charts. Tables and cards are rendered by the server and refreshed
// by htmx; the charts poll the console's JSON endpoints and draw with uPlot.
(function () {
  "use strict";

  const POLL_MS = 2000;
  const COLORS = ["#2f6fdf", "#1f8a4c", "#c4372c", "#8a4fd6", "#b7791f", "#0f8b8d", "#d0487a", "#5a6478"];

  async function getJSON(url) {
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
    return resp.json();
  }

  function withParam(url, key, value) {
    return url + (url.includes("?") ? "&" : "?") + encodeURIComponent(key) + "=" + encodeURIComponent(value);
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "-";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return Number(v.toPrecision(5)).toString();
  }

  function widthOf(el) {
    return Math.max(240, Math.floor(el.clientWidth || el.parentElement.clientWidth || 400));
  }

  // One uPlot per element, made on first data and updated after.
  function draw(el, opts, data) {
    if (el._plot) {
      el._plot.setData(data);
      return el._plot;
    }
    el.innerHTML = "";
    el._plot = new uPlot({ width: widthOf(el), height: 170, legend: { show: false }, ...opts }, data, el);
    return el._plot;
  }

  window.addEventListener("resize", () => {
    for (const el of document.querySelectorAll(".plot")) {
      if (el._plot) el._plot.setSize({ width: widthOf(el), height: 170 });
    }
  });

  function repeat(fn, ms) {
    const run = async () => {
      try {
        await fn();
      } catch (e) {
        console.warn(e);
      }
      setTimeout(run, ms);
    };
    run();
  }

  // ---- a session's curves: one small chart per figure, by step ----
  function sessionCurves(root) {
    const series = new Map(); // name → {steps, values, source}
    let since = 0;
    repeat(async () => {
      const data = await getJSON(withParam(root.dataset.src, "since_step", since));
      for (const [name, s] of Object.entries(data.series)) {
        let cur = series.get(name);
        if (!cur) series.set(name, (cur = { steps: [], values: [], source: data.sources[name] }));
        // the reply repeats steps from `since` on: they replace what was there
        const first = s.steps.length ? s.steps[0] : Infinity;
        while (cur.steps.length && cur.steps[cur.steps.length - 1] >= first) {
          cur.steps.pop();
          cur.values.pop();
        }
        cur.steps.push(...s.steps);
        cur.values.push(...s.values);
      }
      if (data.last_step !== null && data.last_step !== undefined) since = data.last_step;
      render();
      root.dataset.loaded = "true";
    }, POLL_MS);

    function render() {
      if (series.size) root.querySelector(".empty")?.remove();
      let i = 0;
      for (const [name, s] of series) {
        let fig = root.querySelector(`figure[data-metric="${CSS.escape(name)}"]`);
        if (!fig) {
          fig = document.createElement("figure");
          fig.className = "chart" + (s.source === "server" ? " server" : "");
          fig.dataset.metric = name;
          fig.innerHTML = '<figcaption><span class="name"></span><span class="last"></span></figcaption><div class="plot"></div>';
          fig.querySelector(".name").textContent = name;
          root.appendChild(fig);
        }
        const last = s.values[s.values.length - 1];
        fig.querySelector(".last").textContent = `step ${s.steps[s.steps.length - 1]}: ${fmt(last)}`;
        fig.dataset.points = String(s.steps.length);
        const color = COLORS[i++ % COLORS.length];
        draw(fig.querySelector(".plot"), {
          scales: { x: { time: false } },
          axes: [{}, { size: 60, values: (u, vals) => vals.map(fmt) }],
          series: [{ label: "step" }, { label: name, stroke: color, width: 1.5, points: { show: s.steps.length < 60 } }],
        }, [s.steps, s.values]);
      }
    }
  }

  // ---- the overview: tokens/s per served model and requests per minute ----
  function overviewCharts(root) {
    repeat(async () => {
      const data = await getJSON(root.dataset.src);
      const tokens = root.querySelector('[data-chart="tokens"]');
      if (tokens && data.engines.length) {
        const xs = data.engines[0].tokens_per_s.map((p) => p[0]);
        const ys = data.engines.map((e) => e.tokens_per_s.map((p) => p[1]));
        draw(tokens.querySelector(".plot"), {
          series: [{}, ...data.engines.map((e, i) => ({ label: e.name, stroke: COLORS[i % COLORS.length], width: 1.5 }))],
          axes: [{}, { size: 60, values: (u, vals) => vals.map(fmt) }],
        }, [xs, ...ys]);
        tokens.dataset.points = String(xs.length);
      }
      const requests = root.querySelector('[data-chart="requests"]');
      if (requests) {
        const rpm = data.requests_per_minute;
        draw(requests.querySelector(".plot"), {
          series: [{}, { label: "requests/min", stroke: COLORS[1], width: 1.5, fill: "rgba(31,138,76,0.08)" }],
          axes: [{}, { size: 50 }],
        }, [rpm.map((p) => p[0]), rpm.map((p) => p[1])]);
        requests.dataset.points = String(rpm.length);
      }
    }, POLL_MS * 1.5);
  }

  // ---- usage: tokens and cost per day ----
  function usageCharts(root) {
    repeat(async () => {
      const data = await getJSON(root.dataset.src);
      const fig = root.querySelector('[data-chart="days"]');
      if (!fig) return;
      const days = data.days;
      const xs = days.map((d, i) => i); // one slot per day, labelled with its date
      const tokens = days.map((d) => d.prefill_tokens + d.sample_tokens + d.train_tokens);
      const cost = days.map((d) => d.cost_usd);
      const bars = uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({ size: [0.6, 64] }) : undefined;
      draw(fig.querySelector(".plot"), {
        scales: { x: { time: false, range: () => [-0.5, Math.max(days.length, 1) - 0.5] }, usd: { range: (u, min, max) => [0, Math.max(max, 1e-9) * 1.15] }, y: { range: (u, min, max) => [0, Math.max(max, 1) * 1.15] } },
        series: [
          {},
          { label: "tokens", stroke: COLORS[0], fill: "rgba(47,111,223,0.35)", paths: bars, points: { show: false } },
          { label: "cost $", stroke: COLORS[2], width: 2, scale: "usd", points: { show: true, size: 7 } },
        ],
        axes: [
          { splits: () => xs, values: (u, vals) => vals.map((v) => (days[v] ? days[v].day : "")) },
          { size: 70, values: (u, vals) => vals.map(fmt) },
          { side: 1, scale: "usd", size: 80, grid: { show: false }, values: (u, vals) => vals.map((v) => "$" + fmt(v)) },
        ],
      }, [xs, tokens, cost]);
      fig.dataset.points = String(xs.length);
    }, POLL_MS * 2);
  }

  function start() {
    if (typeof uPlot === "undefined") return;
    const curves = document.getElementById("curves");
    if (curves) sessionCurves(curves);
    const overview = document.getElementById("overview-charts");
    if (overview) overviewCharts(overview);
    const usage = document.getElementById("usage-charts");
    if (usage) usageCharts(usage);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
