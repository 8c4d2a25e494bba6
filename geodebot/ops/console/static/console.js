// Live updates for the console: the server says what changed (server-sent events from
// /events), and each marked section of this page that shows it is fetched again and swapped
// in place. No polling: an open page that nothing happens to sends nothing. Without this
// script every page still works; it is only a reload that it saves.
(function () {
  "use strict";
  var body = document.body;
  var url = body.getAttribute("data-events");
  var badge = document.getElementById("live-state");
  if (!url || !window.EventSource || !window.fetch || !window.DOMParser) {
    return;
  }
  var TOPICS = ["runs", "approvals", "jobs", "receipts", "deadletters", "operator"];
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

  function changed(event) {
    var data = {};
    try {
      data = JSON.parse(event.data);
    } catch (e) {
      data = {};
    }
    mark(sections(event.type, data.session));
  }

  var source = new EventSource(url);
  TOPICS.forEach(function (topic) {
    source.addEventListener(topic, changed);
  });
  source.onopen = function () {
    if (badge) {
      badge.setAttribute("data-live-state", "on");
    }
    // Whatever changed between this page's load and now (or, back after a break, while it
    // was away: a restart, or dropped for falling behind) told nobody here: fetched once.
    TOPICS.forEach(function (topic) {
      mark(sections(topic, null));
    });
  };
  source.onerror = function () {
    if (badge) {
      badge.setAttribute("data-live-state", "off");
    }
  };
})();
