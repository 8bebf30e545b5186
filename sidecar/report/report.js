// Draws the report from the JSON embedded in the page (id "report-data"): sortable tables,
// horizontal bar charts and uPlot line plots. Nothing is fetched: uPlot is inlined above.
// Then checks its own layout (text boxes that overlap, plots with nothing drawn and no
// note saying why, labels cut short without their full text on hover) and writes what it
// found into #layout-check, for a headless browser's --dump-dom to read.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const SHOWN_ROWS = 200;  // rows drawn at first; a button draws the rest
  const FOLD_CHARS = 24;  // a text cell longer than this is folded, whole on hover or click
  const NAME_CHARS = 28;  // a job's name (a path) longer than this loses its middle
  const PATHS = new Set(["job", "folder", "name"]);

  // A path's start and end, which tell jobs apart, with "…" for its middle.
  function shorten(text) {
    if (text.length <= NAME_CHARS) return text;
    return text.slice(0, 8) + "…" + text.slice(text.length - NAME_CHARS + 9);
  }

  function cell(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "number") {
      return Number.isInteger(value) ? String(value) : value.toPrecision(4);
    }
    return String(value);
  }

  function element(tag, className, text) {
    const el = document.createElement(tag);
    if (className) el.className = className;
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function note(host, text) {
    host.appendChild(element("p", "no-data", text));
  }

  // A table from {columns, text, rows}; a click on a header sorts by that column (again:
  // reverse). The first SHOWN_ROWS rows are drawn; long text cells are folded.
  function table(id, t, empty) {
    const host = document.getElementById(id);
    if (!t.rows.length) { note(host, empty); return; }
    const el = document.createElement("table");
    const head = el.createTHead().insertRow();
    const body = el.createTBody();
    let sorted = -1, ascending = true, shown = Math.min(SHOWN_ROWS, t.rows.length);
    const more = element("button", "more");
    function fill() {
      body.replaceChildren();
      for (const row of t.rows.slice(0, shown)) {
        const tr = body.insertRow();
        row.forEach((v, i) => {
          const td = tr.insertCell();
          const text = cell(v);
          td.textContent = PATHS.has(t.columns[i]) ? shorten(text) : text;
          if (td.textContent !== text) td.dataset.short = td.textContent;
          if (t.text[i]) td.classList.add("text");
          if (i === 0) td.classList.add("first");
          if (t.text[i] && text.length > FOLD_CHARS) {
            td.classList.add("fold");
            td.title = text;
          }
        });
      }
      more.hidden = shown >= t.rows.length;
      more.textContent = `show all ${t.rows.length} rows (${shown} shown)`;
    }
    body.addEventListener("click", (event) => {
      const td = event.target.closest("td.fold");
      if (!td) return;
      const open = td.classList.toggle("open");
      if (td.dataset.short) td.textContent = open ? td.title : td.dataset.short;
    });
    more.addEventListener("click", () => { shown = t.rows.length; fill(); });
    t.columns.forEach((name, i) => {
      const th = element("th", i === 0 ? "first" : "", name);
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
    host.appendChild(more);
  }

  function figure(id, title) {
    const box = element("div", "figure");
    box.appendChild(element("div", "figure-title", title));
    document.getElementById(id).appendChild(box);
    return box;
  }

  // Horizontal bars, one row per label (cut short, whole on hover), the series stacked
  // left to right; the row's total at its end. Nothing above zero: the note instead.
  function hbars(id, title, labels, series, unit, empty) {
    const box = figure(id, title);
    const totals = labels.map((_, i) => series.reduce((s, x) => s + (x.values[i] || 0), 0));
    const top = Math.max(0, ...totals);
    if (!(top > 0)) { note(box, empty); box.dataset.marks = "0"; return; }
    labels.forEach((label, i) => {
      const row = element("div", "hbar-row");
      const name = element("span", "hbar-label", shorten(label));
      name.title = label;
      const track = element("span", "hbar-track");
      series.forEach((s, k) => {
        const v = s.values[i] || 0;
        if (!(v > 0)) return;
        const seg = element("span", "hbar-seg");
        seg.style.width = (v / top * 100) + "%";
        seg.style.background = COLORS[k % COLORS.length];
        seg.title = `${label}: ${s.label} ${cell(v)} ${unit}`;
        track.appendChild(seg);
      });
      const total = element("span", "hbar-value", cell(totals[i]));
      total.title = `${cell(totals[i])} ${unit}`;
      row.append(name, track, total);
      box.appendChild(row);
    });
    if (series.length > 1) {
      const legend = element("div", "legend");
      series.forEach((s, k) => {
        const item = element("span", "legend-item");
        const key = element("span", "key");
        key.style.background = COLORS[k % COLORS.length];
        item.append(key, document.createTextNode(s.label));
        legend.appendChild(item);
      });
      box.appendChild(legend);
    }
    box.dataset.marks = String(box.querySelectorAll(".hbar-seg").length);
  }

  const jobs = data.jobs.rows.length;
  table("jobs", data.jobs, "No job: no run folder was found.");
  table("gpus", data.gpus, `No GPU data: none of these ${jobs} jobs had a GPU.`);
  table("summary", data.summary, "No job: nothing to total.");
  table("damaged", data.damaged, "None: every run folder was read.");

  for (const [id, by] of [["by-user", "user"], ["by-model", "GPU model"]]) {
    const rows = data.gpu_hours[by];
    hbars(id, "GPU-hours per " + by, rows.labels,
          [{label: "GPU-hours", values: rows.values}], "GPU-hours",
          `No GPU data: none of these ${jobs} jobs had a GPU, so no GPU-hours.`);
  }
  const phases = data.phases;
  hbars("phases", "Share of the mean training iteration (%), jobs with the most GPU-hours",
        phases.labels, phases.series, "%",
        "No phase data: no job stored a measured training iteration.");
  if (!data.utilization.length) {
    note(document.getElementById("utilization"),
         `No GPU data: no GPU was sampled in these ${jobs} jobs.`);
  }
  for (const job of data.utilization) {
    const box = figure("utilization", job.title);
    new uPlot({width: 900, height: 240,
      scales: {x: {time: false}, y: {range: [0, 100]}},
      axes: [{label: "time since start (s)"}, {label: "GPU utilization (%)"}],
      series: [{label: "time (s)"}].concat(job.gpus.map((g, i) => ({
        label: g, stroke: COLORS[i % COLORS.length], spanGaps: true, points: {show: false},
      }))),
    }, job.columns, box);
    const points = job.columns.slice(1).flat().filter((v) => v !== null).length;
    box.dataset.marks = String(points);
  }

  // The page's own check of what a reader sees, written into #layout-check.
  function layoutCheck() {
    const clips = new Map();
    function clipOf(el) {  // the box el's content is clipped to (null: none)
      if (!el || el === document.documentElement) return null;
      if (clips.has(el)) return clips.get(el);
      let clip = clipOf(el.parentElement);
      const style = getComputedStyle(el);
      if (style.overflowX !== "visible" || style.overflowY !== "visible") {
        const r = el.getBoundingClientRect();
        clip = clip ? {left: Math.max(clip.left, r.left), right: Math.min(clip.right, r.right),
                       top: Math.max(clip.top, r.top), bottom: Math.min(clip.bottom, r.bottom)}
          : {left: r.left, right: r.right, top: r.top, bottom: r.bottom};
      }
      clips.set(el, clip);
      return clip;
    }
    const boxes = [];
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const el = node.parentElement;
      if (!node.textContent.trim() || el.closest("script, style, #layout-check")) continue;
      range.selectNodeContents(node);
      for (const r of range.getClientRects()) {
        const clip = clipOf(el);
        const box = {left: r.left, right: r.right, top: r.top, bottom: r.bottom, el: el};
        if (clip) {
          box.left = Math.max(box.left, clip.left); box.right = Math.min(box.right, clip.right);
          box.top = Math.max(box.top, clip.top); box.bottom = Math.min(box.bottom, clip.bottom);
        }
        if (box.right - box.left > 0.5 && box.bottom - box.top > 0.5) boxes.push(box);
      }
    }
    boxes.sort((a, b) => a.top - b.top);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) {
      const a = boxes[i];
      for (let j = i + 1; j < boxes.length && boxes[j].top < a.bottom - 0.5; j++) {
        const b = boxes[j];
        const x = Math.min(a.right, b.right) - Math.max(a.left, b.left);
        const y = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
        if (x > 0.5 && y > 0.5 && a.el !== b.el) {
          overlaps.push(`${a.el.textContent.slice(0, 40)} | ${b.el.textContent.slice(0, 40)}`);
        }
      }
    }
    const empty = [];
    for (const fig of document.querySelectorAll(".figure")) {
      if (fig.dataset.marks === "0" && !fig.querySelector(".no-data")) {
        empty.push(fig.querySelector(".figure-title").textContent);
      }
    }
    for (const section of document.querySelectorAll("section")) {
      const shown = section.querySelector(".figure[data-marks]:not([data-marks='0']), "
                                          + "tbody tr, .no-data");
      if (!shown) empty.push(section.querySelector("h2").textContent);
    }
    const cut = [];
    for (const el of document.querySelectorAll("body *")) {
      if (el.closest("script, style") || el.children.length) continue;
      if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX === "hidden"
          && !(el.title.length >= el.textContent.length && el.title.endsWith(
            el.textContent.slice(-3)))) cut.push(el.textContent.slice(0, 40));
    }
    const out = document.getElementById("layout-check");
    out.dataset.texts = String(boxes.length);
    out.dataset.overlaps = String(overlaps.length);
    out.dataset.empty = String(empty.length);
    out.dataset.cut = String(cut.length);
    out.textContent = JSON.stringify({overlaps: overlaps.slice(0, 20), empty: empty,
                                      cut: cut.slice(0, 20)});
  }

  layoutCheck();
  document.body.dataset.drawn = "yes";
})();
