package idempotencyconnect_test

import (
	"context"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// r32Sig is a binary header value: not valid text, as a signature is.
var r32Sig = string([]byte{0x00, 0x01, 0xfe, 0xff, 'a'})

// r32BinService is the test service on grpc-go: it writes a ledger row and
// sets a binary header (-bin), which grpc-go sends base64-encoded and its
// clients decode.
type r32BinService struct {
	testingv1.UnimplementedPolicyServiceServer
	runs *atomic.Int64
}

func (s r32BinService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	s.runs.Add(1)
	if err := grpc.SetHeader(ctx, metadata.Pairs("x-sig-bin", r32Sig)); err != nil {
		return nil, err
	}
	return ledger(ctx, req)
}

// r32Servers is a grpc-go server with UnaryServerInterceptor and a connect
// handler, on one store; the connect handler sets the same binary header
// as connect-go sends one (connect.EncodeBinaryHeader).
func r32Servers(t *testing.T) (e *env, grpcURL, connectURL string, runs *atomic.Int64) {
	e = newEnv(t)
	runs = new(atomic.Int64)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, r32BinService{runs: runs})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	connectURL = r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Sig-Bin", connect.EncodeBinaryHeader([]byte(r32Sig)))
		return r, nil
	}, nil, nil, nil)
	return e, "http://" + lis.Addr().String(), connectURL, runs
}

// A grpc-go client's call of one key, first to the grpc-go server, then to
// the connect handler (a replica of another framework): the replay carries
// the binary header the first answer carried, byte for byte.
func TestReview32BinaryHeaderFromGRPCServerReplayedByConnect(t *testing.T) {
	t.Parallel()
	e, grpcURL, connectURL, runs := r32Servers(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-bin-1")
	var h1, h2, tr metadata.MD
	first, err := grpcClient(t, grpcURL).Required(ctx, &testingv1.Request{Body: "1"}, grpc.Header(&h1))
	require.NoError(t, err)
	require.Equal(t, []string{r32Sig}, h1.Get("x-sig-bin"), "the first answer's binary header")

	again, err := grpcClient(t, connectURL).Required(ctx, &testingv1.Request{Body: "1"}, grpc.Header(&h2), grpc.Trailer(&tr))
	require.NoError(t, err)
	require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
	require.Equal(t, []string{"true"}, tr.Get(idempotency.ReplayedTrailer), "a replay")
	require.Equal(t, []string{r32Sig}, h2.Get("x-sig-bin"), "the replay's binary header is the first answer's")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// The other way round: first to the connect handler, then to the grpc-go
// server.
func TestReview32BinaryHeaderFromConnectReplayedByGRPCServer(t *testing.T) {
	t.Parallel()
	e, grpcURL, connectURL, runs := r32Servers(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-bin-2")
	var h1, h2, tr metadata.MD
	first, err := grpcClient(t, connectURL).Required(ctx, &testingv1.Request{Body: "2"}, grpc.Header(&h1))
	require.NoError(t, err)
	require.Equal(t, []string{r32Sig}, h1.Get("x-sig-bin"), "the first answer's binary header")

	again, err := grpcClient(t, grpcURL).Required(ctx, &testingv1.Request{Body: "2"}, grpc.Header(&h2), grpc.Trailer(&tr))
	require.NoError(t, err)
	require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
	require.Equal(t, []string{"true"}, tr.Get(idempotency.ReplayedTrailer), "a replay")
	require.Equal(t, []string{r32Sig}, h2.Get("x-sig-bin"), "the replay's binary header is the first answer's")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// Within connect alone: a binary header set by the handler is replayed
// byte for byte to a connect client in each protocol.
func TestReview32BinaryHeaderConnectOnly(t *testing.T) {
	t.Parallel()
	_, _, connectURL, runs := r32Servers(t)
	ctx := context.Background()
	first, err := client(t, connectURL, procRequired, protocols[1], true).CallUnary(ctx, keyed("r32-bin-3", "3"))
	require.NoError(t, err)
	raw, err := connect.DecodeBinaryHeader(first.Header().Get("X-Sig-Bin"))
	require.NoError(t, err)
	require.Equal(t, r32Sig, string(raw))
	for _, p := range protocols {
		resp, err := client(t, connectURL, procRequired, p, true).CallUnary(ctx, keyed("r32-bin-3", "3"))
		require.NoError(t, err, p.name)
		require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), p.name)
		raw, err := connect.DecodeBinaryHeader(resp.Header().Get("X-Sig-Bin"))
		require.NoError(t, err, p.name)
		require.Equal(t, r32Sig, string(raw), p.name)
	}
	require.EqualValues(t, 1, runs.Load())
}
