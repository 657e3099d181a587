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
// ([DefaultDurationBuckets]): the SDK's default boundaries (0, 5, 10, ...
// 10000) are meant for milliseconds and would put every call in le="5".
// The defaults are those OpenTelemetry's HTTP semantic conventions
// recommend (5 ms to 10 s, as otelhttp uses), with 1 ms and 2.5 ms below,
// because a replay or a refused key is answered in a few milliseconds, and
// 15, 30 and 60 s above, for handlers that call slow systems and waits under
// a long WithInProgressWait. [WithDurationBuckets] sets others.
//
// Each call's metrics carry idempotency.outcome (the [idempotency.Outcome]
// names: executed, replayed, released, in_progress, key_reused, rejected,
// unavailable, canceled, misconfigured), idempotency.transport, and the
// method: rpc.system, rpc.service and rpc.method for gRPC;
// http.request.method and http.route for HTTP, the route being the
// template the request matched ("/v1/orders/{id}/refunds", see
// [idempotency.WithHTTPRoute]), never its path, and absent when the
// middleware cannot know it; idempotency.method for a direct call
// (Call.Method); nothing more for a message, whose scope may name one of
// thousands of tenants. So the number of series is bounded by the routes
// and methods a service has, not by its traffic. Through the Prometheus
// exporter, idempotency.calls is idempotency_calls_total with the label
// idempotency_outcome, and idempotency.duration is
// idempotency_duration_seconds.
//
// The span of a call, "idempotency <method>" ("idempotency POST
// /v1/orders/{id}/refunds", "idempotency /pkg.Service/Method",
// "idempotency message"), is a child of the span in the call's context
// (the one an otelgrpc or otelhttp handler started), and carries the same
// attributes, the outcome, the claim, wait, handler and commit times, and
// a message's scope ([ScopeKey]).
//
// A panic in this tracer, as in any, is recovered by the store and never
// reaches the call (see [idempotency.Tracer]).
package idempotencyotel
