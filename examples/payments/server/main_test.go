package main

import (
	"bytes"
	"context"
	"log"
	"net"
	"strings"
	"sync"
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

// syncBuffer is a log destination the test can read while the server writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestServerServesLogsAndStopsGracefully(t *testing.T) {
	db := testdb.New(t, 1) // a private schema, passed as search_path in the URL
	sep := "?"
	if strings.Contains(testdb.URL(), "?") {
		sep = "&"
	}
	url := testdb.URL() + sep + "search_path=" + db.Schema

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var logs syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- run(ctx, lis, url, log.New(&logs, "", 0)) }()

	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idempotency.UnaryClientInterceptors()...))
	require.NoError(t, err)
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)
	callCtx := idempotency.WithOutgoingKey(context.Background(), "server-test-1")
	req := &paymentsv1.ChargeRequest{AccountId: "acct", AmountCents: 42}
	var first *paymentsv1.ChargeResponse
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

	cancel()
	select {
	case err := <-stopped:
		require.NoError(t, err, "graceful shutdown")
	case <-time.After(15 * time.Second):
		t.Fatal("server did not stop")
	}
	out := logs.String()
	for _, want := range []string{"executed", "replayed", "mismatch", "shutting down"} {
		require.Contains(t, out, want)
	}
}
