// Drives ComfyUI's own frontend in headless Chromium (playwright-core) for tests/frontend/workflows.py and
// tests/test_frontend.py.
//
//   node driver.cjs JOB.json RESULT.json
//
// JOB = {"url": "http://127.0.0.1:8188", "chromium": "/usr/bin/chromium", "tasks": [TASK, ...]}
// TASK "build": {"kind": "build", "name", "api": {API-format graph}, "overrides": {node id: {input: value}},
//               "properties": {node id: {property: value}}, "note": {"title", "text", "width"}}
//   -> {"workflow": UI-format JSON}: the graph made by the frontend's own API-JSON import (app.loadApiJson), the
//      overrides applied to the widgets, seeds fixed, laid out in columns by link depth, a MarkdownNote added, then
//      app.graph.serialize() (what the frontend saves).
// TASK "check": {"kind": "check", "name", "workflow": {UI JSON}, "scan": bool (default true), "screenshot": path|null,
//               "preview": path|null}
//   -> {"errors_text": overlay text, "error_count", "unknown_types", "missing_inputs", "prompt": graphToPrompt's
//      output, "console": [...], "screenshot": path}: app.loadGraphData as a user's drag-and-drop does, then what the
//      frontend reports (its error overlay: missing nodes, missing models), our required-input check against the
//      node definitions, and the API prompt the frontend would queue. "preview": a PNG of the graph alone.
// Every task starts from a fresh page state (dialogs closed). Node, playwright-core and Chromium only; nothing is
// downloaded (Chromium runs with the background-networking flags off).
'use strict';
const fs = require('fs');
const { chromium } = require('playwright-core');

const CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];

async function dismiss(page) {
  for (let i = 0; i < 4; i++) {
    await page.keyboard.press('Escape');
    await page.waitForTimeout(150);
  }
}

async function openApp(page, url) {
  await page.goto(url, { waitUntil: 'networkidle', timeout: 180000 });
  await page.waitForFunction(() => window.app && window.app.graph && window.app.vueAppReady && window.LiteGraph,
    null, { timeout: 180000 });
  await page.waitForTimeout(500);
  await dismiss(page);
}

async function build(page, task) {
  return await page.evaluate(async (task) => {
    const app = window.app, LG = window.LiteGraph;
    await app.loadApiJson(task.api, `${task.name}.json`);
    const graph = app.graph;
    const missing = Object.values(task.api).filter(n => !LG.registered_node_types[n.class_type]);
    if (missing.length) throw new Error(`node types unknown to this ComfyUI: ${missing.map(n => n.class_type)}`);
    for (const [id, values] of Object.entries(task.overrides || {})) {
      const node = graph.getNodeById(Number(id));
      if (!node) throw new Error(`override for a missing node ${id}`);
      for (const [name, value] of Object.entries(values)) {
        const w = (node.widgets || []).find(w => w.name === name);
        if (!w) throw new Error(`${node.type} #${id}: no widget ${name}`);
        w.value = value;
      }
    }
    for (const node of graph.nodes) {
      for (const w of node.widgets || []) {
        if (w.name === 'control_after_generate') w.value = 'fixed';  // reproducible seeds
      }
    }
    for (const [id, props] of Object.entries(task.properties || {})) {
      const node = graph.getNodeById(Number(id));
      Object.assign(node.properties, props);
    }
    // layout: columns by the longest link path from a source node, rows in API id order
    const nodes = graph.nodes.slice().sort((a, b) => a.id - b.id);
    const depth = new Map(nodes.map(n => [n.id, 0]));
    for (let pass = 0; pass < nodes.length; pass++) {
      let changed = false;
      for (const n of nodes) {
        for (const input of n.inputs || []) {
          if (input.link == null) continue;
          const link = graph.links.get ? graph.links.get(input.link) : graph.links[input.link];
          if (!link) continue;
          const d = depth.get(link.origin_id) + 1;
          if (d > depth.get(n.id)) { depth.set(n.id, d); changed = true; }
        }
      }
      if (!changed) break;
    }
    // a source node (no linked input) sits just left of its first consumer, not in column 0
    for (const n of nodes) {
      if ((n.inputs || []).some(i => i.link != null)) continue;
      let first = Infinity;
      for (const out of n.outputs || []) {
        for (const id of out.links || []) {
          const link = graph.links.get ? graph.links.get(id) : graph.links[id];
          if (link) first = Math.min(first, depth.get(link.target_id));
        }
      }
      if (first !== Infinity) depth.set(n.id, Math.max(0, first - 1));
    }
    const columns = [];
    for (const n of nodes) {
      const d = depth.get(n.id);
      (columns[d] = columns[d] || []).push(n);
    }
    const GAP_X = 60, GAP_Y = 50, TOP = 60;
    let x = 40;
    let noteNode = null;
    if (task.note) {
      noteNode = LG.createNode('MarkdownNote');
      if (!noteNode) throw new Error('MarkdownNote is not available in this frontend');
      noteNode.title = task.note.title || 'Note';
      noteNode.widgets[0].value = task.note.text;
      graph.add(noteNode);
      noteNode.size = [task.note.width || 520, task.note.height || 640];
      noteNode.pos = [x, TOP];
      x += noteNode.size[0] + GAP_X;
    }
    for (const column of columns) {
      if (!column) continue;
      let y = TOP, width = 0;
      for (const n of column) {
        const size = n.computeSize();
        n.size = [Math.max(n.size[0], size[0], 320), Math.max(n.size[1], size[1])];
        if (n.type === 'LoadImage') n.size[1] = Math.max(n.size[1], 380);  // room for the image preview
        n.pos = [x, y];
        y += n.size[1] + GAP_Y + 30;
        width = Math.max(width, n.size[0]);
      }
      x += width + GAP_X;
    }
    graph.setDirtyCanvas(true, true);
    const wf = graph.serialize();
    delete wf.extra.ds;  // opened fitted to the window, not at this page's scroll position
    return wf;
  }, task);
}

async function check(page, task) {
  const consoleLines = [];
  const onConsole = m => consoleLines.push(`${m.type()}: ${m.text()}`);
  page.on('console', onConsole);
  try {
    await page.evaluate(async (task) => {
      // scan: false skips the frontend's missing-model / missing-media scans (for a clean preview picture)
      await window.app.loadGraphData(task.workflow, true, true, `${task.name}.json`,
                                     { skipAssetScans: task.scan === false });
    }, task);
    await page.waitForTimeout(2500);  // the missing-model / missing-media pipelines run after the load resolves
    // frontend >= 1.49 shows a summary ("3 errors found" / "Missing node: X") and lists the errors on "View details"
    const details = page.getByText('View details', { exact: true });
    if (await details.count()) {
      await details.first().click();
      await page.waitForTimeout(1000);
    }
    const report = await page.evaluate(async () => {
      const app = window.app, LG = window.LiteGraph;
      const unknown = app.graph.nodes.filter(n => !(n.type in LG.registered_node_types)).map(n => n.type);
      const missingInputs = [];
      for (const node of app.graph.nodes) {
        const def = LG.registered_node_types[node.type]?.nodeData;
        if (!def || !def.input) continue;
        for (const name of Object.keys(def.input.required || {})) {
          const slot = (node.inputs || []).find(i => i.name === name);
          const widget = (node.widgets || []).find(w => w.name === name);
          const linked = slot && slot.link != null;
          if (!linked && !widget) missingInputs.push(`${node.type} #${node.id} (${node.title}): ${name}`);
          if (!linked && widget && (widget.value === undefined || widget.value === null))
            missingInputs.push(`${node.type} #${node.id} (${node.title}): ${name} has no value`);
        }
      }
      const { output } = await app.graphToPrompt();
      const text = document.body.innerText;
      // 1.43: "N ERRORS" in the overlay; 1.49: "K nodes — N errors" in the details panel
      const m = text.match(/(\d+)\s+ERRORS?\b/) || text.match(/\u2014\s*(\d+)\s+errors?\b/i);
      const lines = text.split('\n').map(s => s.trim()).filter(s => /missing|error|invalid|not found/i.test(s));
      return { unknown_types: unknown, missing_inputs: missingInputs, prompt: output,
               error_count: m ? Number(m[1]) : 0, errors_text: lines, node_count: app.graph.nodes.length };
    });
    report.console = consoleLines.slice();
    if (task.screenshot) {
      await page.evaluate(() => window.app.extensionManager.command.execute('Comfy.Canvas.FitView'));
      await page.waitForTimeout(500);
      await page.screenshot({ path: task.screenshot });
      report.screenshot = task.screenshot;
    }
    if (task.preview) {  // the graph alone at full detail: everything but the canvas and its DOM widgets hidden
      const style = await page.addStyleTag({ content: `
        body * { visibility: hidden !important; }
        #graph-canvas, .dom-widget, .dom-widget * { visibility: visible !important; }` });
      await page.evaluate(() => {
        window.app.canvas.min_font_size_for_lod = 0;  // no low-quality boxes when zoomed out (not persisted)
        window.app.canvas.show_info = false;  // no FPS / node-count text
        return window.app.extensionManager.command.execute('Comfy.Canvas.FitView');
      });
      await page.waitForTimeout(800);
      await page.evaluate(() => window.app.canvas.setDirty(true, true));
      await page.waitForTimeout(400);
      await page.screenshot({ path: task.preview });
      await style.evaluate(el => el.remove());
      report.preview = task.preview;
    }
    return report;
  } finally {
    page.off('console', onConsole);
  }
}

(async () => {
  const [jobPath, resultPath] = process.argv.slice(2);
  const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'));
  const browser = await chromium.launch({ executablePath: job.chromium || '/usr/bin/chromium', headless: true,
                                          args: CHROMIUM_ARGS });
  const results = [];
  try {
    const page = await browser.newPage({ viewport: job.viewport || { width: 1600, height: 1000 } });
    const pageErrors = [];
    page.on('pageerror', e => pageErrors.push(String(e && e.message || e)));
    await openApp(page, job.url);
    for (const task of job.tasks) {
      await dismiss(page);
      const before = pageErrors.length;
      let out;
      try {
        out = task.kind === 'build' ? { workflow: await build(page, task) } : await check(page, task);
      } catch (e) {
        out = { exception: String(e && e.stack || e) };
      }
      out.name = task.name;
      out.kind = task.kind;
      out.page_errors = pageErrors.slice(before);
      results.push(out);
    }
  } finally {
    await browser.close();
  }
  fs.writeFileSync(resultPath, JSON.stringify(results, null, 1));
})().catch(e => { console.error(e); process.exit(1); });
