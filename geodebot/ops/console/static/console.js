// Live updates for the console: the server says what changed (server-sent events from
// /events), and each marked section of this page that shows it is fetched again and swapped
// in place. No polling: an open page that nothing happens to sends nothing. Without this
// script every page still works; it is only a reload that it saves.
//
// All tabs of one browser share one stream: a browser opens at most six HTTP/1.1
// connections to a host, and a stream per tab would leave a seventh tab none to load with.
// The tab holding the Web Lock "geodebot-console-live" (held for as long as the page lives)
// follows /events and passes on every event on the BroadcastChannel of the same name; the
// others listen there. When that tab goes, the next one waiting for the lock takes the
// stream over. Without Web Locks or BroadcastChannel each tab follows the stream itself.
(function () {
  "use strict";
  var body = document.body;
  var url = body.getAttribute("data-events");
  var badge = document.getElementById("live-state");
  if (!url || !window.EventSource || !window.fetch || !window.DOMParser) {
    return;
  }
  var TOPICS = ["runs", "approvals", "jobs", "receipts", "deadletters", "operator", "pairing", "memory"];
  var SHARED = "geodebot-console-live";
  var pending = {};
  var timer = null;

  function sections(topic, session) {
    var found = [];
    var marked = document.querySelectorAll("[data-live]");
    for (var i = 0; i < marked.length; i++) {
      var el = marked[i];
      var topics = el.getAttribute("data-live").split(/\s+/);
      var only = el.getAttribute("data-session");
      if (topics.indexOf(topic) >= 0 && (!only || !session || only === session) && el.id) {
        found.push(el.id);
      }
    }
    return found;
  }

  function refresh() {
    timer = null;
    var ids = Object.keys(pending);
    pending = {};
    fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) {
        return response.ok ? response.text() : null;
      })
      .then(function (html) {
        if (html === null) {
          return;
        }
        var fresh = new DOMParser().parseFromString(html, "text/html");
        ids.forEach(function (id) {
          var now = document.getElementById(id);
          var next = fresh.getElementById(id);
          // An unchanged section stays as it is: replaced, it would take the button under
          // the pointer and what was typed into its forms with it.
          if (now && next && !now.isEqualNode(next)) {
            now.replaceWith(document.importNode(next, true));
          }
        });
        var count = Number(body.getAttribute("data-refreshed") || "0") + 1;
        body.setAttribute("data-refreshed", String(count));
      })
      .catch(function () {
        // The daemon is restarting or gone: the next event (or reconnect) tries again.
      });
  }

  function mark(ids) {
    ids.forEach(function (id) {
      pending[id] = true;
    });
    if (Object.keys(pending).length && timer === null) {
      // Events come in bursts (a turn's tool calls): one fetch for the burst.
      timer = window.setTimeout(refresh, 250);
    }
  }

  function state(on) {
    if (badge) {
      badge.setAttribute("data-live-state", on ? "on" : "off");
    }
  }

  // What this page does with a message of the stream, its own or passed on by the tab that
  // follows it: {type: a topic, data: its JSON}, {type: "opened"} or {type: "closed"}.
  function heard(message) {
    if (message.type === "opened") {
      state(true);
      // Whatever changed between this page's load and now (or, back after a break, while it
      // was away: a restart, dropped for falling behind, a new tab following the stream)
      // told nobody here: fetched once.
      TOPICS.forEach(function (topic) {
        mark(sections(topic, null));
      });
    } else if (message.type === "closed") {
      state(false);
    } else if (TOPICS.indexOf(message.type) >= 0) {
      var data = {};
      try {
        data = JSON.parse(message.data);
      } catch (e) {
        data = {};
      }
      mark(sections(message.type, data.session));
    }
  }

  // Follows /events, each message to ``tell``; the stream, to ask whether it is open.
  function follow(tell) {
    var source = new EventSource(url);
    TOPICS.forEach(function (topic) {
      source.addEventListener(topic, function (event) {
        tell({ type: topic, data: event.data });
      });
    });
    source.onopen = function () {
      tell({ type: "opened" });
    };
    source.onerror = function () {
      tell({ type: "closed" });
    };
    return source;
  }

  if (!navigator.locks || !navigator.locks.request || !window.BroadcastChannel) {
    body.setAttribute("data-live-role", "own");
    follow(heard);
    return;
  }

  // Each page's name on the channel: an answer to its greeting is for it alone.
  var me = String(Math.random()).slice(2) + String(Date.now());
  var channel = new BroadcastChannel(SHARED);
  var source = null;
  body.setAttribute("data-live-role", "follow");
  channel.onmessage = function (event) {
    var message = event.data || {};
    if (message.type === "hello") {
      // A page just opened: the stream's state is news to it (not to the others).
      if (source !== null) {
        channel.postMessage({ type: "state", to: message.from, open: source.readyState === 1 });
      }
    } else if (message.type === "state") {
      if (message.to === me) {
        heard({ type: message.open ? "opened" : "closed" });
      }
    } else if (source === null) {
      heard(message);
    }
  };
  channel.postMessage({ type: "hello", from: me });
  navigator.locks.request(SHARED, function () {
    body.setAttribute("data-live-role", "lead");
    source = follow(function (message) {
      heard(message);
      channel.postMessage(message);
    });
    window.addEventListener("pagehide", function () {
      // The others go without updates until the next tab in line has the stream open.
      channel.postMessage({ type: "closed" });
    });
    // Held until the page goes: then the lock passes to the next tab waiting for it.
    return new Promise(function () {});
  });
})();
