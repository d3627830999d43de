// meshfs page: keeps the server-rendered sections live over one event stream. Without this
// script the page still reads (and its filter form still works); with it, each `update` event
// replaces the sections it names, and the filter opens a new stream instead of a reload.
"use strict";
(function () {
  var form = document.getElementById("filter");
  var live = document.getElementById("live");
  if (!form || !live || !window.EventSource) return;
  // Minutes east of UTC: the server writes times at the reader's offset.
  var tz = String(-new Date().getTimezoneOffset());
  form.elements.tz.value = tz;
  var stream = null;

  function query() {
    var q = new URLSearchParams(new FormData(form));
    q.set("tz", tz);
    return q.toString();
  }

  function state(text, on) {
    live.textContent = text;
    live.className = on ? "live on" : "live off";
  }

  function connect() {
    if (stream) stream.close();
    stream = new EventSource("/events?" + query());
    stream.addEventListener("update", function (e) {
      var parts = JSON.parse(e.data);
      Object.keys(parts).forEach(function (id) {
        var el = document.getElementById(id);
        if (el) el.innerHTML = parts[id];
      });
      state("live", true);
    });
    stream.onerror = function () {
      if (stream.readyState === EventSource.CLOSED) {
        state("not live: reload the page; if the daemon restarted, open it again with `meshfs ui`", false);
      } else {
        state("reconnecting…", false);
      }
    };
  }

  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var q = new URLSearchParams(new FormData(form));
    q.delete("tz");
    history.replaceState(null, "", "/?" + q.toString());
    connect();
  });
  state("connecting…", false);
  connect();
})();
