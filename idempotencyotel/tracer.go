package idempotencyotel

import (
	"context"
	"errors"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/idempotency"
)

// scopeName names this instrumentation to OpenTelemetry.
const scopeName = "github.com/exactlyonce/idempotency/idempotencyotel"

// Attribute keys of this package.
const (
	OutcomeKey   = attribute.Key("idempotency.outcome")
	TransportKey = attribute.Key("idempotency.transport")
	// ScopeKey is a message's scope, on its span; never on metrics.
	ScopeKey = attribute.Key("idempotency.scope")
)

// Tracer is an [idempotency.Tracer] and [idempotency.CleanerTracer] that
// reports to OpenTelemetry. Make it with [NewTracer] and give it to the
// store with idempotency.WithTracer.
type Tracer struct {
	tracer   trace.Tracer
	calls    metric.Int64Counter
	duration metric.Float64Histogram
	wait     metric.Float64Histogram
	deleted  metric.Int64Counter
}

var (
	_ idempotency.Tracer        = (*Tracer)(nil)
	_ idempotency.CleanerTracer = (*Tracer)(nil)
)

// NewTracer makes the instruments. It fails when an option is invalid or
// the meter provider refuses an instrument.
func NewTracer(opts ...Option) (*Tracer, error) {
	o, err := evaluateOptions(opts)
	if err != nil {
		return nil, err
	}
	if o.meters == nil {
		o.meters = otel.GetMeterProvider()
	}
	if o.tracers == nil {
		o.tracers = otel.GetTracerProvider()
	}
	meter := o.meters.Meter(scopeName)
	t := &Tracer{tracer: o.tracers.Tracer(scopeName)}
	var errs [4]error
	t.calls, errs[0] = meter.Int64Counter("idempotency.calls",
		metric.WithDescription("Calls handled by the idempotency layer, by outcome."), metric.WithUnit("{call}"))
	buckets := metric.WithExplicitBucketBoundaries(o.buckets...)
	t.duration, errs[1] = meter.Float64Histogram("idempotency.duration",
		metric.WithDescription("Duration of a call, as its transport saw it."), metric.WithUnit("s"), buckets)
	t.wait, errs[2] = meter.Float64Histogram("idempotency.wait.duration",
		metric.WithDescription("Time a call waited for another call that held its key."), metric.WithUnit("s"), buckets)
	t.deleted, errs[3] = meter.Int64Counter("idempotency.cleaner.deleted",
		metric.WithDescription("Expired keys deleted by the cleaner."), metric.WithUnit("{key}"))
	if err := errors.Join(errs[:]...); err != nil {
		return nil, err
	}
	return t, nil
}

// TraceCallStart starts the call's span, a child of ctx's.
func (t *Tracer) TraceCallStart(ctx context.Context, data idempotency.TraceCallStartData) context.Context {
	attrs := callAttributes(data)
	if data.Scope != "" {
		// On the span only: a scope can be one of thousands of tenants.
		attrs = append(attrs, ScopeKey.String(data.Scope))
	}
	ctx, _ = t.tracer.Start(ctx, spanName(data), trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
	return ctx
}

// spanName is "idempotency " and the call's method: bounded, as
// TraceCallStartData.Method is; a message's, whose scope may not be, is
// "idempotency message".
func spanName(data idempotency.TraceCallStartData) string {
	if data.Transport == idempotency.TransportMessage || data.Method == "" {
		return "idempotency " + string(data.Transport)
	}
	return "idempotency " + data.Method
}

// TraceCallEnd records the call's metrics and ends its span.
func (t *Tracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) {
	attrs := append(callAttributes(data.TraceCallStartData), OutcomeKey.String(data.Outcome.String()))
	set := metric.WithAttributeSet(attribute.NewSet(attrs...))
	t.calls.Add(ctx, 1, set)
	t.duration.Record(ctx, data.Duration.Seconds(), set)
	if data.Wait > 0 {
		t.wait.Record(ctx, data.Wait.Seconds(), set)
	}
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(OutcomeKey.String(data.Outcome.String()),
		attribute.Float64("idempotency.claim.duration", data.Claim.Seconds()),
		attribute.Float64("idempotency.wait.duration", data.Wait.Seconds()),
		attribute.Float64("idempotency.handler.duration", data.Handler.Seconds()),
		attribute.Float64("idempotency.commit.duration", data.Commit.Seconds()))
	if data.Err != nil && data.Outcome != idempotency.OutcomeReplayed && data.Outcome != idempotency.OutcomeExecuted {
		span.SetStatus(codes.Error, data.Err.Error())
	}
	span.End()
}

// TraceCleanerBatch counts the keys a cleaner batch deleted.
func (t *Tracer) TraceCleanerBatch(ctx context.Context, data idempotency.TraceCleanerBatchData) {
	if data.Deleted > 0 {
		t.deleted.Add(ctx, data.Deleted)
	}
}

// callAttributes names the call's transport and method in the semantic
// conventions' terms: rpc.* for gRPC, http.request.method and http.route
// for HTTP. They label the metrics, so they hold nothing unbounded: a
// message's scope is left out.
func callAttributes(data idempotency.TraceCallStartData) []attribute.KeyValue {
	attrs := []attribute.KeyValue{TransportKey.String(string(data.Transport))}
	switch data.Transport {
	case idempotency.TransportGRPC, idempotency.TransportConnect:
		// The semantic conventions' rpc.system of connect-go is connect_rpc.
		system := "grpc"
		if data.Transport == idempotency.TransportConnect {
			system = "connect_rpc"
		}
		service, method, _ := strings.Cut(strings.TrimPrefix(data.Method, "/"), "/")
		attrs = append(attrs, attribute.String("rpc.system", system), attribute.String("rpc.service", service), attribute.String("rpc.method", method))
	case idempotency.TransportHTTP:
		method, route, _ := strings.Cut(data.Method, " ")
		attrs = append(attrs, attribute.String("http.request.method", method))
		// As otelhttp: the route from its path on, without a pattern's
		// host; none when the route is not known.
		if i := strings.IndexByte(route, '/'); i >= 0 {
			attrs = append(attrs, attribute.String("http.route", route[i:]))
		}
	case idempotency.TransportMessage:
	default:
		attrs = append(attrs, attribute.String("idempotency.method", data.Method))
	}
	return attrs
}
