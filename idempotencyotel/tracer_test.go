package idempotencyotel_test

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyotel"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.RunWithLeakCheck(m)) }

// A gRPC server whose store reports to an in-memory meter and span
// recorder: each outcome is counted with its method, the durations are
// recorded, the cleaner's deletions counted, and each call has a span under
// the incoming one.
func TestMetricsAndSpans(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tracers := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = meters.Shutdown(context.Background()); _ = tracers.Shutdown(context.Background()) })
	tracer, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters), idempotencyotel.WithTracerProvider(tracers))
	require.NoError(t, err)

	db := testdb.New(t, 4)
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool, idempotency.WithTracer(tracer))
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))

	// The incoming span, as otelgrpc's server handler would start it.
	parent := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		ctx, span := tracers.Tracer("test").Start(ctx, "grpc server")
		defer span.End()
		return h(ctx, req)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(parent, idempotency.UnaryServerInterceptor(store)))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "test.v1.Ledger", HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Charge", Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &wrapperspb.StringValue{}
			if err := dec(req); err != nil {
				return nil, err
			}
			return icpt(ctx, req, &grpc.UnaryServerInfo{FullMethod: "/test.v1.Ledger/Charge"}, func(ctx context.Context, req any) (any, error) {
				return req, nil
			})
		}}},
	}, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	call := func(key, body string) error {
		ctx := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
		return conn.Invoke(ctx, "/test.v1.Ledger/Charge", wrapperspb.String(body), &wrapperspb.StringValue{})
	}
	require.NoError(t, call("k", "x"))
	require.NoError(t, call("k", "x"))
	require.Error(t, call("k", "y"))
	require.Error(t, call("bad key", "x"))

	_, err = store.Execute(ctx, idempotency.Call{Key: "short", Method: "m", TTL: time.Millisecond},
		func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond)
	n, err := store.DeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	metrics := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			metrics[m.Name] = m
		}
	}
	calls := metrics["idempotency.calls"].Data.(metricdata.Sum[int64])
	got := map[string]int64{}
	for _, dp := range calls.DataPoints {
		outcome, _ := dp.Attributes.Value("idempotency.outcome")
		method, _ := dp.Attributes.Value("rpc.method")
		if method.AsString() == "" {
			method, _ = dp.Attributes.Value("idempotency.method")
		}
		got[outcome.AsString()+" "+method.AsString()] += dp.Value
		if transport, _ := dp.Attributes.Value("idempotency.transport"); transport.AsString() == "grpc" {
			service, _ := dp.Attributes.Value("rpc.service")
			require.Equal(t, "test.v1.Ledger", service.AsString())
		}
	}
	require.Equal(t, map[string]int64{"executed Charge": 1, "replayed Charge": 1, "key_reused Charge": 1, "rejected Charge": 1, "executed m": 1}, got)
	durations := metrics["idempotency.duration"].Data.(metricdata.Histogram[float64])
	var count uint64
	for _, dp := range durations.DataPoints {
		count += dp.Count
		require.Positive(t, dp.Sum)
	}
	require.EqualValues(t, 5, count)
	deleted := metrics["idempotency.cleaner.deleted"].Data.(metricdata.Sum[int64])
	require.EqualValues(t, 1, deleted.DataPoints[0].Value)

	var ours int
	for _, s := range spans.Ended() {
		if s.Name() != "idempotency /test.v1.Ledger/Charge" {
			continue
		}
		ours++
		require.True(t, s.Parent().IsValid(), "a child of the incoming span")
		var outcome attribute.Value
		for _, kv := range s.Attributes() {
			if kv.Key == idempotencyotel.OutcomeKey {
				outcome = kv.Value
			}
		}
		require.NotEmpty(t, outcome.AsString())
	}
	require.Equal(t, 4, ours)
}
