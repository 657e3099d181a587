package idempotencyotel_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyotel"
)

// collect reads every metric the reader holds, by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	metrics := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			metrics[m.Name] = m
		}
	}
	return metrics
}

// bucketOf returns the upper bound of the bucket holding the histogram's
// only recording (+Inf for the last).
func bucketOf(t *testing.T, m metricdata.Metrics) (bounds []float64, upper float64) {
	t.Helper()
	h := m.Data.(metricdata.Histogram[float64])
	require.Len(t, h.DataPoints, 1)
	dp := h.DataPoints[0]
	require.EqualValues(t, 1, dp.Count)
	for i, n := range dp.BucketCounts {
		if n == 1 {
			if i == len(dp.Bounds) {
				return dp.Bounds, math.Inf(1)
			}
			return dp.Bounds, dp.Bounds[i]
		}
	}
	t.Fatalf("no bucket holds the recording: %v", dp.BucketCounts)
	return nil, 0
}

// It failed when the histograms in seconds had the SDK's default buckets
// (0, 5, 10, 25, ... 10000, meant for milliseconds): a replay of 2 ms, a call
// of 20 ms and a wait of 30 s all landed in le="5".
func TestDurationHistogramsHaveBucketsInSeconds(t *testing.T) {
	t.Parallel()
	record := func(duration, wait time.Duration) map[string]metricdata.Metrics {
		reader := sdkmetric.NewManualReader()
		meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		t.Cleanup(func() { _ = meters.Shutdown(context.Background()) })
		tracer, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters))
		require.NoError(t, err)
		data := idempotency.TraceCallStartData{Transport: idempotency.TransportGRPC, Method: "/test.v1.Ledger/Charge", Key: "k"}
		ctx := tracer.TraceCallStart(context.Background(), data)
		tracer.TraceCallEnd(ctx, idempotency.TraceCallEndData{TraceCallStartData: data, Outcome: idempotency.OutcomeReplayed, Duration: duration, Wait: wait})
		return collect(t, reader)
	}

	m := record(20*time.Millisecond, 0)
	bounds, upper := bucketOf(t, m["idempotency.duration"])
	require.Equal(t, idempotencyotel.DefaultDurationBuckets(), bounds)
	require.Less(t, upper, 0.05, "a 20 ms call is told apart from a 50 ms one")
	require.Equal(t, 0.025, upper)

	_, replay := bucketOf(t, record(2*time.Millisecond, 0)["idempotency.duration"])
	require.Equal(t, 0.0025, replay, "a 2 ms replay is told apart from a 5 ms one")

	m = record(31*time.Second, 30*time.Second)
	_, wait := bucketOf(t, m["idempotency.wait.duration"])
	require.Equal(t, 30.0, wait, "a 30 s wait is told apart from a 10 s one")
	_, call := bucketOf(t, m["idempotency.duration"])
	require.Equal(t, 60.0, call)
}

// WithDurationBuckets sets the boundaries of both histograms; boundaries
// that cannot be a histogram's make NewTracer fail, saying which.
func TestWithDurationBuckets(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = meters.Shutdown(context.Background()) })
	mine := []float64{0.01, 0.1, 1}
	tracer, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters), idempotencyotel.WithDurationBuckets(mine))
	require.NoError(t, err)
	mine[0] = 5 // the caller's slice is the caller's
	data := idempotency.TraceCallStartData{Transport: idempotency.TransportGRPC, Method: "/test.v1.Ledger/Charge", Key: "k"}
	ctx := tracer.TraceCallStart(context.Background(), data)
	tracer.TraceCallEnd(ctx, idempotency.TraceCallEndData{TraceCallStartData: data, Outcome: idempotency.OutcomeInProgress, Duration: 50 * time.Millisecond, Wait: 2 * time.Second})
	m := collect(t, reader)
	bounds, upper := bucketOf(t, m["idempotency.duration"])
	require.Equal(t, []float64{0.01, 0.1, 1}, bounds)
	require.Equal(t, 0.1, upper)
	bounds, upper = bucketOf(t, m["idempotency.wait.duration"])
	require.Equal(t, []float64{0.01, 0.1, 1}, bounds)
	require.True(t, math.IsInf(upper, 1))

	for _, c := range []struct {
		bounds []float64
		says   string
	}{
		{nil, "no boundaries given"},
		{[]float64{0.1, 0.05}, "boundary 1 (0.05) is not above the one before it (0.1)"},
		{[]float64{0.1, 0.1}, "boundary 1 (0.1) is not above the one before it (0.1)"},
		{[]float64{0, 1}, "boundary 0 is 0"},
		{[]float64{-1, 1}, "boundary 0 is -1"},
		{[]float64{1, math.NaN()}, "boundary 1 is NaN"},
		{[]float64{1, math.Inf(1)}, "boundary 1 is +Inf"},
	} {
		_, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters), idempotencyotel.WithDurationBuckets(c.bounds))
		require.ErrorContains(t, err, "idempotencyotel: WithDurationBuckets: "+c.says, "%v", c.bounds)
	}
}
