// polar dashboard: renders each snapshot the server pushes over /events.
// Every string in a snapshot may be the agent's (session and task ids, tool names, error reasons): the DOM is built
// with createElement and textContent only, and links are relative paths with the id percent-encoded.
'use strict';
(function () {
  var SVG = 'http://www.w3.org/2000/svg';
  var PALETTE = ['#5b8def', '#e0a800', '#1e8e3e', '#c0392b', '#6a1b9a', '#00838f'];

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === 'object' && c !== null ? c : document.createTextNode(c == null ? '' : String(c)));
    });
    return node;
  }

  function svgEl(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (text != null) node.textContent = String(text);
    return node;
  }

  function fmt(x, digits) {
    return typeof x === 'number' && isFinite(x) ? x.toFixed(digits == null ? 3 : digits) : '–';
  }

  function estimate(e) {
    if (!e || e.mean == null) return '–';
    return fmt(e.mean) + (e.se != null ? ' ± ' + fmt(e.se) : '') + (e.n != null ? ' (n=' + e.n + ')' : '');
  }

  function counts(obj) {
    return Object.keys(obj || {}).filter(function (k) { return obj[k]; })
      .map(function (k) { return k + ' ' + obj[k]; }).join(', ');
  }

  function fill(id, nodes) {
    var target = document.getElementById(id);
    target.replaceChildren.apply(target, nodes);
  }

  function rows(tableId, data, cells, emptyText) {
    var body = document.querySelector('#' + tableId + ' tbody');
    var width = document.querySelectorAll('#' + tableId + ' thead th').length;
    var out = data.map(function (d) {
      return el('tr', {}, cells(d).map(function (c) { return c instanceof Node && c.tagName === 'TD' ? c : el('td', {}, [c]); }));
    });
    if (!out.length) out = [el('tr', {}, [el('td', { colspan: width, 'class': 'empty' }, [emptyText || 'none yet'])])];
    body.replaceChildren.apply(body, out);
  }

  function chips(id, obj, kind) {
    var keys = Object.keys(obj || {}).sort();
    fill(id, keys.length ? keys.map(function (k) {
      var attrs = { 'class': 'chip', 'data-count': obj[k] };
      attrs['data-' + kind] = k;
      return el('span', attrs, [el('b', {}, [obj[k]]), k]);
    }) : [el('span', { 'class': 'empty' }, ['none yet'])]);
  }

  // Bars with SE whiskers: items [{label, mean, se}], values in [0, 1] unless they go beyond.
  function barChart(items) {
    var w = Math.max(240, 46 * items.length + 50), h = 170, top = 10, bottom = 40, left = 36;
    var max = Math.max(1, Math.max.apply(null, items.map(function (d) { return (d.mean || 0) + (d.se || 0); })));
    var min = Math.min(0, Math.min.apply(null, items.map(function (d) { return (d.mean || 0) - (d.se || 0); })));
    var y = function (v) { return top + (h - top - bottom) * (max - v) / (max - min || 1); };
    var svg = svgEl('svg', { width: w, height: h, role: 'img' });
    svg.appendChild(svgEl('line', { 'class': 'axis', x1: left, x2: w - 4, y1: y(0), y2: y(0) }));
    [min, max].forEach(function (v) { svg.appendChild(svgEl('text', { x: 2, y: y(v) + 4 }, fmt(v, 1))); });
    items.forEach(function (d, i) {
      var x = left + 8 + i * 46;
      if (d.mean != null) {
        var bar = svgEl('rect', { 'class': 'bar', x: x, width: 28, y: Math.min(y(d.mean), y(0)),
          height: Math.abs(y(0) - y(d.mean)) });
        bar.appendChild(svgEl('title', {}, d.label + ': ' + estimate(d)));
        svg.appendChild(bar);
        if (d.se) {
          svg.appendChild(svgEl('line', { 'class': 'err', x1: x + 14, x2: x + 14, y1: y(d.mean - d.se), y2: y(d.mean + d.se) }));
        }
      }
      var label = String(d.label);
      svg.appendChild(svgEl('text', { x: x, y: h - bottom + 14 }, label.length > 7 ? label.slice(0, 6) + '…' : label));
    });
    return svg;
  }

  // Lines over iterations with SE whiskers: series {name: [{x, mean, se}]}.
  function lineChart(series) {
    var names = Object.keys(series);
    var points = [].concat.apply([], names.map(function (n) { return series[n]; }));
    var xs = points.map(function (p) { return p.x; });
    var w = 360, h = 170, top = 10, bottom = 28, left = 36, right = 80;
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var max = Math.max(1, Math.max.apply(null, points.map(function (p) { return (p.mean || 0) + (p.se || 0); })));
    var x = function (v) { return left + (w - left - right) * (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)); };
    var y = function (v) { return top + (h - top - bottom) * (max - v) / max; };
    var svg = svgEl('svg', { width: w, height: h, role: 'img' });
    svg.appendChild(svgEl('line', { 'class': 'axis', x1: left, x2: w - right, y1: y(0), y2: y(0) }));
    svg.appendChild(svgEl('text', { x: 2, y: y(max) + 4 }, fmt(max, 1)));
    svg.appendChild(svgEl('text', { x: 2, y: y(0) + 4 }, '0'));
    svg.appendChild(svgEl('text', { x: x(x0), y: h - 8 }, x0));
    if (x1 !== x0) svg.appendChild(svgEl('text', { x: x(x1), y: h - 8 }, x1));
    names.forEach(function (name, i) {
      var color = PALETTE[i % PALETTE.length];
      var pts = series[name].filter(function (p) { return p.mean != null; });
      svg.appendChild(svgEl('polyline', { 'class': 'line', stroke: color,
        points: pts.map(function (p) { return x(p.x) + ',' + y(p.mean); }).join(' ') }));
      pts.forEach(function (p) {
        var dot = svgEl('circle', { cx: x(p.x), cy: y(p.mean), r: 3, fill: color });
        dot.appendChild(svgEl('title', {}, name + ' at ' + p.x + ': ' + estimate(p)));
        svg.appendChild(dot);
        if (p.se) svg.appendChild(svgEl('line', { 'class': 'err', x1: x(p.x), x2: x(p.x), y1: y(p.mean - p.se), y2: y(p.mean + p.se) }));
      });
      svg.appendChild(svgEl('text', { x: w - right + 6, y: top + 12 + 14 * i, fill: color }, name));
    });
    return svg;
  }

  function renderLoop(loop) {
    var section = document.getElementById('loop-section');
    section.hidden = !loop;
    if (!loop) return;
    var its = loop.iterations || [];
    fill('iter-chart', its.length ? [lineChart({ reward: its.map(function (it) {
      return { x: it.iteration, mean: it.reward_mean, se: it.reward_se };
    }) })] : [el('span', { 'class': 'empty' }, ['no iteration yet'])]);
    var evals = loop.evals || [], series = {};
    evals.forEach(function (ev) {
      Object.keys(ev.pass || {}).forEach(function (k) {
        (series[k] = series[k] || []).push({ x: ev.iteration, mean: ev.pass[k].mean, se: ev.pass[k].se });
      });
    });
    fill('eval-chart', Object.keys(series).length ? [lineChart(series)]
      : [el('span', { 'class': 'empty' }, ['no held-out eval (polar loop --eval)'])]);
    rows('iterations', its, function (it) {
      return [it.iteration, estimate({ mean: it.reward_mean, se: it.reward_se }), it.train || '–', fmt(it.push_s, 1)];
    });
    rows('evals', evals, function (ev) {
      return [ev.iteration, Object.keys(ev.pass || {}).map(function (k) { return k + ' ' + estimate(ev.pass[k]); }).join(', ')];
    }, 'no held-out eval');
  }

  function render(snap) {
    document.getElementById('path').textContent = snap.path;
    document.getElementById('kind').textContent = snap.kind || 'nothing yet';
    document.getElementById('updated').textContent = new Date().toLocaleTimeString();
    fill('problems', (snap.problems || []).map(function (p) { return el('li', {}, [p]); }));
    chips('stages', snap.totals.stages, 'stage');
    chips('statuses', snap.totals.statuses, 'status');
    renderLoop(snap.loop);

    var runs = snap.runs || [];
    rows('runs', runs, function (r) {
      return [el('td', { 'class': 'mono' }, [r.name]), r.running ? 'running' : 'ended', r.total == null ? '–' : r.total,
        counts(r.stages), counts(r.statuses), fmt(r.sessions_per_minute, 1), estimate(r.reward)];
    });
    var latest = runs.slice().reverse().find(function (r) { return Object.keys(r.groups || {}).length; });
    document.getElementById('groups-run').textContent = latest ? latest.name : '–';
    fill('group-chart', latest ? [barChart(Object.keys(latest.groups).map(function (g) {
      var e = latest.groups[g];
      return { label: g, mean: e.mean, se: e.se, n: e.n };
    }))] : [el('span', { 'class': 'empty' }, ['no rewarded session yet'])]);
    var errors = [];
    runs.forEach(function (r) { (r.errors || []).forEach(function (e) { errors.push([r.name, e[0], e[1]]); }); });
    rows('errors', errors, function (e) {
      return [el('td', { 'class': 'mono' }, [e[0]]), el('td', { 'class': 'mono' }, [e[1]]), el('td', { 'class': 'reason' }, [e[2]])];
    });

    var harnesses = snap.harnesses || {};
    rows('harnesses', Object.keys(harnesses), function (h) {
      var s = harnesses[h];
      return [h, s.sessions, s.calls, fmt(s.merge_rate), counts(s.breaks) || 'none'];
    });
    var e = snap.engine;
    fill('engine', e ? [['calls', e.calls], ['latency p50 s', fmt(e.latency_p50_s)], ['latency p95 s', fmt(e.latency_p95_s)],
      ['sampled tokens', e.tokens], ['tokens/s', fmt(e.tokens_per_s, 1)]].map(function (kv) {
      return el('span', { 'class': 'chip' }, [el('b', {}, [kv[1]]), kv[0]]);
    }) : [el('span', { 'class': 'empty' }, ['no calls stored yet'])]);

    rows('sessions', snap.sessions || [], function (s) {
      var link = el('a', { href: '/session/' + encodeURIComponent(s.session_id) }, [s.session_id]);
      return [el('td', { 'class': 'mono' }, [link]), s.task_id, s.group_id, s.harness,
        el('td', { 'class': 'status-' + String(s.status).replace(/[^a-z_]/g, '') }, [s.status]),
        fmt(s.reward), s.calls + (s.failed_calls ? ' (' + s.failed_calls + ' failed)' : ''),
        el('td', { 'class': 'reason' }, [s.reason == null ? '' : s.reason])];
    });
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  var live = document.getElementById('live');
  var source = new EventSource('/events');
  source.addEventListener('snapshot', function (event) {
    live.dataset.state = 'live';
    live.textContent = 'live';
    render(JSON.parse(event.data));
  });
  source.onerror = function () {
    live.dataset.state = 'reconnecting';
    live.textContent = 'reconnecting…';
  };
})();
