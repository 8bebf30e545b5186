// Draws the report from the JSON embedded in the page (id "report-data"): sortable tables
// and uPlot plots. Nothing is fetched: uPlot is inlined above this script.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

  function cell(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "number") {
      return Number.isInteger(value) ? String(value) : value.toPrecision(4);
    }
    return String(value);
  }

  // A table from {columns, rows}; a click on a header sorts by that column (again: reverse).
  function table(id, t) {
    const host = document.getElementById(id);
    const el = document.createElement("table");
    const head = el.createTHead().insertRow();
    const body = el.createTBody();
    let sorted = -1, ascending = true;
    function fill() {
      body.replaceChildren();
      for (const row of t.rows) {
        const tr = body.insertRow();
        row.forEach((v) => { tr.insertCell().textContent = cell(v); });
      }
    }
    t.columns.forEach((name, i) => {
      const th = document.createElement("th");
      th.textContent = name;
      th.title = "sort";
      th.addEventListener("click", () => {
        ascending = sorted === i ? !ascending : true;
        sorted = i;
        const sign = ascending ? 1 : -1;
        t.rows.sort((a, b) => {
          const x = a[i], y = b[i];
          if (x === y) return 0;
          if (x === null) return 1;
          if (y === null) return -1;
          return (typeof x === "number" && typeof y === "number"
                  ? x - y : String(x).localeCompare(String(y))) * sign;
        });
        fill();
      });
      head.appendChild(th);
    });
    fill();
    host.appendChild(el);
  }

  function plot(id, title, opts, columns) {
    const box = document.createElement("div");
    box.className = "plot";
    document.getElementById(id).appendChild(box);
    return new uPlot(Object.assign({title: title, width: 900, height: 260}, opts), columns, box);
  }

  // Categories on x (0..n-1): bars, several series stacked by drawing running totals,
  // the largest first, so each smaller one covers the bottom of the one before.
  function bars(id, title, labels, series, unit, what) {
    const x = labels.map((_, i) => i);
    const totals = [];
    let running = labels.map(() => 0);
    for (const s of series) {
      running = running.map((v, i) => v + (s.values[i] || 0));
      totals.push(running);
    }
    const order = series.map((_, i) => i).reverse();
    const bar = uPlot.paths.bars({size: [0.7, 60]});
    plot(id, title, {
      scales: {x: {time: false, range: [-0.5, labels.length - 0.5]}},
      axes: [{splits: () => x, values: (u, ticks) => ticks.map((t) => labels[t] ?? "")},
             {label: unit, size: 70,
              values: (u, ticks) => ticks.map((v) => String(+v.toPrecision(3)))}],
      series: [{label: what, value: (u, v) => v === null ? "" : labels[v]}].concat(order.map((i) => ({
        label: series[i].label, fill: COLORS[i % COLORS.length],
        stroke: COLORS[i % COLORS.length], paths: bar, points: {show: false},
        value: (u, v, si, di) => di === null ? "" : cell(series[i].values[di]),
      }))),
    }, [x].concat(order.map((i) => totals[i])));
  }

  table("jobs", data.jobs);
  table("gpus", data.gpus);
  table("summary", data.summary);
  if (data.damaged.rows.length) table("damaged", data.damaged);

  for (const job of data.utilization) {
    plot("utilization", job.title, {
      scales: {x: {time: false}, y: {range: [0, 100]}},
      axes: [{label: "time since start (s)"}, {label: "GPU utilization (%)"}],
      series: [{label: "time (s)"}].concat(job.gpus.map((g, i) => ({
        label: g, stroke: COLORS[i % COLORS.length], spanGaps: true, points: {show: false},
      }))),
    }, job.columns);
  }
  const phases = data.phases;
  if (phases.labels.length) {
    bars("phases", "Phase breakdown per job (share of the training iteration, %)",
         phases.labels, phases.series, "%", "job");
  }
  for (const [id, by] of [["by-user", "user"], ["by-model", "GPU model"]]) {
    const rows = data.gpu_hours[by];
    bars(id, "GPU-hours per " + by, rows.labels, [{label: "GPU-hours", values: rows.values}],
         "GPU-hours", by);
  }
  document.body.dataset.drawn = "yes";
})();
