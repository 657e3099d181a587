// Package idempotencyotel reports what an idempotency store does to
// OpenTelemetry: a metric per call outcome, histograms of how long calls and
// waits for in-progress duplicates take, a counter of the keys the expiry
// cleaner deletes, and a span per call. It lives in a module of its own, so
// the core package stays free of OpenTelemetry.
//
//	tracer, err := idempotencyotel.NewTracer() // the global providers, or WithMeterProvider / WithTracerProvider
//	...
//	store, err := idempotency.NewStore(pool, idempotency.WithTracer(tracer))
//
// Metrics:
//
//	idempotency.calls            counter    calls by outcome
//	idempotency.duration         histogram  seconds: the whole call, as its transport saw it
//	idempotency.wait.duration    histogram  seconds waited for an in-progress duplicate (calls that waited)
//	idempotency.cleaner.deleted  counter    expired keys deleted by the cleaner
//
// The two histograms have buckets in seconds, from 1 ms to 60 s
// ([DefaultDurationBuckets]: those of OpenTelemetry's HTTP semantic
// conventions, with two below for replays and three above for long waits);
// [WithDurationBuckets] sets others.
//
// Each call's metrics carry idempotency.outcome (the [idempotency.Outcome]
// names: executed, replayed, released, in_progress, key_reused, rejected,
// unavailable, canceled, misconfigured) and idempotency.transport, and the method: rpc.system,
// rpc.service and rpc.method for gRPC, http.route for HTTP. Through the
// Prometheus exporter, idempotency.calls is idempotency_calls_total with
// the label idempotency_outcome.
//
// The span of a call, "idempotency <method>", is a child of the span in the
// call's context (the one an otelgrpc or otelhttp handler started), and
// carries the outcome and the claim, wait, handler and commit times.
package idempotencyotel
