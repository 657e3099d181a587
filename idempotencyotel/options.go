package idempotencyotel

import (
	"fmt"
	"math"
	"slices"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Option configures [NewTracer].
type Option func(*options)

type options struct {
	meters  metric.MeterProvider
	tracers trace.TracerProvider
	buckets []float64
	err     error
}

// DefaultDurationBuckets returns the bucket boundaries, in seconds, of the
// duration histograms unless [WithDurationBuckets] sets others: those
// OpenTelemetry's HTTP semantic conventions recommend for
// http.server.request.duration (5 ms to 10 s, as otelhttp and otelgrpc use),
// with 1 ms and 2.5 ms below them, because a replay or a refused key is
// answered in a few milliseconds and would otherwise all fall in the first
// bucket, and 15 s, 30 s and 60 s above, for handlers that call slow
// systems and for waits under a long WithInProgressWait. The SDK's own
// default (0, 5, 10, 25, ... 10000) is for milliseconds: on a histogram in
// seconds it puts every call in one bucket.
func DefaultDurationBuckets() []float64 {
	return []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 30, 60}
}

func defaultOptions() options {
	return options{buckets: DefaultDurationBuckets()}
}

// evaluateOptions applies opts to the defaults and checks the result,
// naming the option at fault.
func evaluateOptions(opts []Option) (options, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return o, o.err
}

// WithMeterProvider sets where metrics go. Defaults to otel's global
// provider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) { o.meters = mp }
}

// WithTracerProvider sets where spans go. Defaults to otel's global
// provider.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) { o.tracers = tp }
}

// WithDurationBuckets sets the bucket boundaries, in seconds, of
// idempotency.duration and idempotency.wait.duration. They must be
// positive, finite and strictly increasing, and there must be at least one;
// otherwise [NewTracer] fails. Each boundary is one more time series per
// label set in Prometheus. A view of the meter provider that sets an
// aggregation for these instruments overrides them. Defaults to
// [DefaultDurationBuckets].
func WithDurationBuckets(bounds []float64) Option {
	return func(o *options) {
		if err := checkBuckets(bounds); err != nil && o.err == nil {
			o.err = err
		}
		o.buckets = slices.Clone(bounds)
	}
}

func checkBuckets(bounds []float64) error {
	if len(bounds) == 0 {
		return fmt.Errorf("idempotencyotel: WithDurationBuckets: no boundaries given; leave the option out for the defaults (DefaultDurationBuckets)")
	}
	for i, b := range bounds {
		switch {
		case math.IsNaN(b) || math.IsInf(b, 0) || b <= 0:
			return fmt.Errorf("idempotencyotel: WithDurationBuckets: boundary %d is %v; boundaries are durations in seconds, positive and finite", i, b)
		case i > 0 && b <= bounds[i-1]:
			return fmt.Errorf("idempotencyotel: WithDurationBuckets: boundary %d (%v) is not above the one before it (%v); give them in increasing order, each once", i, b, bounds[i-1])
		}
	}
	return nil
}
