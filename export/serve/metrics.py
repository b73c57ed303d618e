"""The server's metrics in the Prometheus text format (version 0.0.4), without a client library."""

import math


def _label_text(labels):
    if not labels:
        return ""
    escaped = (
        (name, str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for name, value in labels
    )
    return "{" + ",".join(f'{name}="{value}"' for name, value in escaped) + "}"


class _Metric:
    def __init__(self, name, kind, help_text):
        self.name, self.kind, self.help = name, kind, help_text

    def header(self):
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A counter with labels, rendered as `name{labels} value`."""

    def __init__(self, name, help_text):
        super().__init__(name, "counter", help_text)
        self.values = {}

    def inc(self, amount=1, **labels):
        key = tuple(sorted((name, str(value)) for name, value in labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def render(self):
        return self.header() + [f"{self.name}{_label_text(key)} {value}" for key, value in sorted(self.values.items())]


class Gauge(_Metric):
    """A gauge read when rendered (`read()` gives its value)."""

    def __init__(self, name, help_text, read):
        super().__init__(name, "gauge", help_text)
        self.read = read

    def render(self):
        return self.header() + [f"{self.name} {self.read()}"]


class Histogram(_Metric):
    """A histogram with fixed upper bounds: cumulative `_bucket{le=...}`, `_sum` and `_count`."""

    def __init__(self, name, help_text, buckets):
        super().__init__(name, "histogram", help_text)
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    def render(self):
        lines, total = self.header(), 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum:.6g}", f"{self.name}_count {total}"]


class Metrics:
    """The server's counters, gauges and histograms (updated on the event loop)."""

    def __init__(self, queue_depth, in_flight, ready, searching_sentences=lambda: 0, searching_requests=lambda: 0):
        powers = [2**i for i in range(11)]
        self.requests = Counter("kt_serve_requests_total", "HTTP requests by path and status code.")
        self.errors = Counter("kt_serve_errors_total", "Requests answered with an error, by reason.")
        self.sentences = Counter("kt_serve_sentences_total", "Sentences translated and answered.")
        self.latency = Histogram(
            "kt_serve_request_duration_seconds", "Time from the start of a translate request to its answer.",
            [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
        )
        self.batch_sentences = Histogram("kt_serve_batch_sentences", "Sentences per search.", powers[:10])
        self.batch_tokens = Histogram(
            "kt_serve_batch_tokens", "Padded source tokens (rows x longest row) per search.", [16 * p for p in powers]
        )
        self.search_seconds = Histogram(
            "kt_serve_search_duration_seconds", "Time of one search (a batch) in the worker thread.",
            [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.queue_wait = Histogram(
            "kt_serve_queue_wait_seconds", "Time from a request's arrival to the start of the search of each of its "
            "sentences.", [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.dropped_sentences = Counter(
            "kt_serve_dropped_sentences_total",
            "Sentences that left a running search because their request ended unanswered (client gone, deadline).",
        )
        for counter in (self.sentences, self.dropped_sentences):  # unlabelled: a sample from the start
            counter.inc(0)
        self.gauges = [
            Gauge("kt_serve_queue_sentences", "Sentences waiting for a search.", queue_depth),
            Gauge("kt_serve_requests_in_flight", "Requests being received, waiting or searched.", in_flight),
            Gauge("kt_serve_sentences_in_flight", "Sentences in the running search (dropped ones not counted).",
                  searching_sentences),
            Gauge("kt_serve_requests_searching", "Requests with a sentence in the running search.", searching_requests),
            Gauge("kt_serve_ready", "1 when the model is loaded and warm and the server is not draining.", ready),
        ]

    def render(self):
        metrics = [self.requests, self.errors, self.sentences, self.dropped_sentences, self.latency, self.queue_wait,
                   self.batch_sentences, self.batch_tokens, self.search_seconds, *self.gauges]
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"
