package idempotencyotel_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyotel"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// telemetry is a store reporting to an in-memory meter and span recorder.
type telemetry struct {
	db     *testdb.DB
	store  *idempotency.Store
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
}

func newTelemetry(t *testing.T) *telemetry {
	t.Helper()
	tel := &telemetry{reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(tel.reader))
	tracers := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tel.spans))
	t.Cleanup(func() { _ = meters.Shutdown(context.Background()); _ = tracers.Shutdown(context.Background()) })
	tracer, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters), idempotencyotel.WithTracerProvider(tracers))
	require.NoError(t, err)
	tel.db = testdb.New(t, 4)
	tel.store, err = idempotency.NewStore(tel.db.Pool, idempotency.WithTracer(tracer))
	require.NoError(t, err)
	require.NoError(t, tel.store.Migrate(context.Background()))
	return tel
}

// series returns the label sets of the calls counter and of the duration
// histogram, each as a string, and how many calls each counted.
func (tel *telemetry) series(t *testing.T) (calls map[string]int64, durations int) {
	t.Helper()
	metrics := collect(t, tel.reader)
	calls = map[string]int64{}
	for _, dp := range metrics["idempotency.calls"].Data.(metricdata.Sum[int64]).DataPoints {
		calls[labels(dp.Attributes)] += dp.Value
	}
	return calls, len(metrics["idempotency.duration"].Data.(metricdata.Histogram[float64]).DataPoints)
}

func labels(set attribute.Set) string {
	var kvs []string
	for _, kv := range set.ToSlice() {
		kvs = append(kvs, string(kv.Key)+"="+kv.Value.Emit())
	}
	return strings.Join(kvs, " ")
}

// spanNames counts the ended spans by name.
func (tel *telemetry) spanNames() map[string]int {
	names := map[string]int{}
	for _, s := range tel.spans.Ended() {
		names[s.Name()]++
	}
	return names
}

func post(h http.Handler, target, key string) int {
	req := httptest.NewRequest(http.MethodPost, target, strings.NewReader(`{"amount":100}`))
	req.Header.Set(idempotency.HeaderKey, key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w.Code
}

// It failed when HTTPMiddleware(store)(mux) labelled each call with its
// path: 1,000 refunds of 1,000 orders were 1,000 series of each metric and
// 1,000 span names, and 1,000 requests to no route were 1,000 more, each
// with a key row kept for a day. Now: one series, one span name, no row for
// what the mux does not route.
func TestHTTPTelemetryIsBoundedByRoutes(t *testing.T) {
	t.Parallel()
	tel := newTelemetry(t)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/orders/{id}/refunds", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})
	h := idempotency.HTTPMiddleware(tel.store)(mux)
	for i := range 1000 {
		require.Equal(t, http.StatusCreated, post(h, fmt.Sprintf("/v1/orders/%d/refunds", i), fmt.Sprintf("k-%d", i)))
		require.Equal(t, http.StatusNotFound, post(h, fmt.Sprintf("/v1/orders/%d/refund", i), fmt.Sprintf("u-%d", i)))
	}
	calls, durations := tel.series(t)
	require.Equal(t, map[string]int64{
		"http.request.method=POST http.route=/v1/orders/{id}/refunds idempotency.outcome=executed idempotency.transport=http": 1000,
	}, calls)
	require.Equal(t, 1, durations)
	require.Equal(t, map[string]int{"idempotency POST /v1/orders/{id}/refunds": 1000}, tel.spanNames())
	require.Equal(t, 1000, tel.db.Count(t, `SELECT count(*) FROM idempotency_keys`), "no key row for the 1,000 unrouted requests")

	// A router the middleware cannot ask (chi's r.Use) and no
	// WithHTTPRoute: the method alone, never the path.
	tel = newTelemetry(t)
	opaque := idempotency.HTTPMiddleware(tel.store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { mux.ServeHTTP(w, r) }))
	for i := range 100 {
		require.Equal(t, http.StatusCreated, post(opaque, fmt.Sprintf("/v1/orders/%d/refunds", i), fmt.Sprintf("k-%d", i)))
	}
	calls, durations = tel.series(t)
	require.Equal(t, map[string]int64{"http.request.method=POST idempotency.outcome=executed idempotency.transport=http": 100}, calls)
	require.Equal(t, 1, durations)
	require.Equal(t, map[string]int{"idempotency POST": 100}, tel.spanNames())
}

// It failed when a message's method was its scope: 100 tenants' scopes
// were 100 series of each metric and 100 span names. The scope is on the
// span alone.
func TestMessageScopesAreNotMetricLabels(t *testing.T) {
	t.Parallel()
	tel := newTelemetry(t)
	ctx := context.Background()
	for i := range 100 {
		outcome, err := tel.store.ProcessMessage(ctx, idempotency.Message{Scope: fmt.Sprintf("tenant-%d/orders", i), ID: "m-1"},
			func(context.Context, pgx.Tx) error { return nil })
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeExecuted, outcome)
	}
	calls, durations := tel.series(t)
	require.Equal(t, map[string]int64{"idempotency.outcome=executed idempotency.transport=message": 100}, calls)
	require.Equal(t, 1, durations)
	require.Equal(t, map[string]int{"idempotency message": 100}, tel.spanNames())
	scopes := map[string]bool{}
	for _, s := range tel.spans.Ended() {
		for _, kv := range s.Attributes() {
			if kv.Key == idempotencyotel.ScopeKey {
				scopes[kv.Value.AsString()] = true
			}
		}
	}
	require.Len(t, scopes, 100, "each span names its message's scope")
}
