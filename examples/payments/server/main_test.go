package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return lis
}

// dial is a client of the server on lis through the library's client interceptor.
func dial(t *testing.T, lis net.Listener) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// requireStopped waits for run to return after its context was cancelled.
func requireStopped(t *testing.T, stopped <-chan error) {
	t.Helper()
	select {
	case err := <-stopped:
		require.NoError(t, err, "graceful shutdown")
	case <-time.After(15 * time.Second):
		t.Fatal("server did not stop")
	}
}

func TestServerServesLogsAndStopsGracefully(t *testing.T) {
	db := testdb.New(t, 1) // a private schema, passed as search_path in the URL
	url := db.URL()

	lis, httpLis, connectLis, metricsLis, providerLis := listen(t), listen(t), listen(t), listen(t), listen(t)
	var logs testdb.SyncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() {
		stopped <- run(ctx, listeners{grpc: lis, http: httpLis, connect: connectLis, metrics: metricsLis, provider: providerLis}, config{databaseURL: url}, slog.New(slog.NewTextHandler(&logs, nil)))
	}()

	conn := dial(t, lis)
	client := paymentsv1.NewPaymentServiceClient(conn)
	callCtx := idempotency.WithOutgoingKey(context.Background(), "server-test-1")
	req := &paymentsv1.ChargeRequest{AccountId: "acct", AmountCents: 42}
	var first *paymentsv1.ChargeResponse
	var err error
	require.Eventually(t, func() bool { first, err = client.Charge(callCtx, req); return err == nil }, 10*time.Second, 50*time.Millisecond)
	again, err := client.Charge(callCtx, req)
	require.NoError(t, err)
	require.Equal(t, first.GetChargeId(), again.GetChargeId())
	_, err = client.Charge(callCtx, &paymentsv1.ChargeRequest{AccountId: "acct", AmountCents: 43})
	require.Error(t, err)

	// Reflection lists the service, so grpcurl and friends can call it.
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(context.Background())
	require.NoError(t, err)
	require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	require.Contains(t, names, "payments.v1.PaymentService")
	require.NoError(t, stream.CloseSend())

	// The same service as JSON over HTTP (-http-addr).
	httpReq, err := http.NewRequest(http.MethodPost, "http://"+httpLis.Addr().String()+"/v1/charges", strings.NewReader(`{"account_id": "acct", "amount_cents": 8}`))
	require.NoError(t, err)
	httpReq.Header.Set(idempotency.HeaderKey, "server-test-http")
	httpReq.Header.Set("Authorization", "Bearer demo-token-alice")
	httpResp, err := http.DefaultClient.Do(httpReq)
	require.NoError(t, err)
	httpBody, _ := io.ReadAll(httpResp.Body)
	httpResp.Body.Close()
	require.Equal(t, http.StatusOK, httpResp.StatusCode, string(httpBody))
	require.Contains(t, string(httpBody), `"balance_cents":"50"`, "42 over gRPC, then 8 over HTTP, on one account")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM provider_charges`), "the provider this process serves charged each executed charge once")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger JOIN provider_charges ON provider_charges.id = ledger.provider_charge_id`), "every ledger row names its provider charge")

	// The same service with connect-go (-connect-addr), here in the
	// Connect protocol with JSON, as curl sends it: a charge and its
	// replay, marked so; without a token, Unauthenticated (401).
	connectCharge := func(token string) (*http.Response, string) {
		req, err := http.NewRequest(http.MethodPost, "http://"+connectLis.Addr().String()+"/payments.v1.PaymentService/Charge",
			strings.NewReader(`{"account_id": "acct", "amount_cents": 5}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idempotency.HeaderKey, "server-test-connect")
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(body)
	}
	charged, body := connectCharge("demo-token-alice")
	require.Equal(t, http.StatusOK, charged.StatusCode, body)
	require.Contains(t, body, `"balanceCents":"55"`, "42, 8, then 5 with connect, on one account")
	replayed, replayedBody := connectCharge("demo-token-alice")
	require.Equal(t, body, replayedBody, "the replay, byte for byte")
	require.Equal(t, "true", replayed.Header.Get("Trailer-"+idempotency.ReplayedTrailer))
	unauthenticated, _ := connectCharge("")
	require.Equal(t, http.StatusUnauthorized, unauthenticated.StatusCode)

	// Prometheus scrapes the store's metrics (-metrics-addr).
	metricsResp, err := http.Get("http://" + metricsLis.Addr().String() + "/metrics")
	require.NoError(t, err)
	scraped, _ := io.ReadAll(metricsResp.Body)
	metricsResp.Body.Close()
	require.Equal(t, http.StatusOK, metricsResp.StatusCode)
	for _, want := range []string{
		`idempotency_calls_total{idempotency_outcome="replayed",idempotency_transport="grpc",otel_scope_name=`,
		`idempotency_calls_total{http_request_method="POST",http_route="/v1/charges",idempotency_outcome="executed",idempotency_transport="http"`,
		`rpc_method="Charge",rpc_service="payments.v1.PaymentService",rpc_system="grpc"} 1`,
		`# TYPE idempotency_duration_seconds histogram`,
		`le="0.0025"}`, // buckets in seconds, not the SDK's default ones for milliseconds
	} {
		require.Contains(t, string(scraped), want)
	}

	cancel()
	requireStopped(t, stopped)
	out := logs.String()
	for _, want := range []string{
		`level=INFO msg="idempotency call" transport=http method="POST /v1/charges" scope=alice outcome=executed`,
		"level=INFO msg=\"idempotency call\" transport=grpc method=/payments.v1.PaymentService/Charge attempt=1 outcome=executed",
		"outcome=replayed",
		"level=WARN msg=\"idempotency call\" transport=grpc method=/payments.v1.PaymentService/Charge attempt=1 outcome=key_reused",
		"code=FailedPrecondition",
		"shutting down",
		`level=INFO msg="idempotency call" service=provider transport=http method="POST /v1/charges" scope=payments-example outcome=executed`,
	} {
		require.Contains(t, out, want)
	}
	for _, key := range []string{"server-test-", "dk2-"} {
		require.NotContains(t, out, key, "the log carries no key, the client's nor a derived one")
	}
}

// With -outbox the call commits a job, and the worker in the same process
// charges the provider and settles the ledger row.
func TestServerOutboxSettlesCharges(t *testing.T) {
	db := testdb.New(t, 1)
	url := db.URL()
	lis, providerLis := listen(t), listen(t)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() {
		stopped <- run(ctx, listeners{grpc: lis, provider: providerLis}, config{databaseURL: url, outbox: true}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	conn := dial(t, lis)
	client := paymentsv1.NewPaymentServiceClient(conn)
	callCtx := idempotency.WithOutgoingKey(context.Background(), "server-outbox-1")
	var resp *paymentsv1.ChargeResponse
	var err error
	require.Eventually(t, func() bool {
		resp, err = client.Charge(callCtx, &paymentsv1.ChargeRequest{AccountId: "acct", AmountCents: 42})
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool {
		return db.Count(t, `SELECT count(*) FROM ledger WHERE charge_id = $1 AND provider_charge_id IS NOT NULL`, resp.GetChargeId()) == 1
	}, 30*time.Second, 50*time.Millisecond, "the worker settles the row")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM provider_charges`))
	cancel()
	requireStopped(t, stopped)
}

// -h shows where the database URL comes from, never its password.
func TestHelpHidesThePassword(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://app:s3cret-pw@db.internal:5432/payments")
	var help bytes.Buffer
	fs := flag.NewFlagSet("server", flag.ContinueOnError)
	fs.SetOutput(&help)
	_, err := parseFlags(fs, []string{"-h"})
	require.ErrorIs(t, err, flag.ErrHelp)
	require.NotContains(t, help.String(), "s3cret-pw")
	require.Contains(t, help.String(), "postgres://app:xxxxx@db.internal:5432/payments")

	cfg, err := parseFlags(flag.NewFlagSet("server", flag.ContinueOnError), nil)
	require.NoError(t, err)
	require.Equal(t, "postgres://app:s3cret-pw@db.internal:5432/payments", cfg.databaseURL, "the real URL is still used")
}
