package idempotencyconnect_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// An application sets the key header in the map in gRPC's lower case (as
// HTTP/2 sends it), through the client interceptor: the call is sent with
// that one key, and executes.
func TestReview32LowerCaseKeyHeaderThroughTheClient(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h, keys := keysSeen(e.mux)
	url := serve(t, h)
	req := connect.NewRequest(&testingv1.Request{Body: "lc"})
	req.Header()["idempotency-key"] = []string{"r32-lower"}
	resp, err := client(t, url, procRequired, protocols[0], false).CallUnary(context.Background(), req)
	require.NoError(t, err, "one key, set once")
	require.Positive(t, resp.Msg.GetLedgerId())
	require.Equal(t, []string{"r32-lower"}, keys())
	require.Equal(t, 1, e.ledgerRows())
}

// A handler's own error that is a context error of its own making (a
// sub-operation's deadline, while the call's context is alive): connect
// sends it as DeadlineExceeded, and so does grpc-go; with the
// idempotency interceptor the code must stay.
func TestReview32HandlersOwnDeadlineErrorKeepsItsCode(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		sub, cancel := context.WithTimeout(ctx, time.Nanosecond)
		defer cancel()
		<-sub.Done()
		return nil, sub.Err()
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	plainMux := http.NewServeMux()
	plainMux.Handle(procRequired, connect.NewUnaryHandler(procRequired, fn))
	plainURL := serve(t, plainMux)
	ctx := context.Background()
	_, err := client(t, plainURL, procRequired, protocols[0], true).CallUnary(ctx, keyed("r32-dl", "1"))
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err), "connect without the interceptor: %v", err)

	// grpc-go with UnaryServerInterceptor keeps it too.
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, r32Work{work: func(ctx context.Context, _ *testingv1.Request) (*testingv1.Response, error) {
		sub, cancel := context.WithTimeout(ctx, time.Nanosecond)
		defer cancel()
		<-sub.Done()
		return nil, sub.Err()
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	_, err = grpcClient(t, "http://"+lis.Addr().String()).Required(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "r32-dl-grpc"), &testingv1.Request{Body: "1"})
	require.Equal(t, codes.DeadlineExceeded, status.Code(err), "grpc-go with the interceptor: %v", err)

	for _, p := range protocols {
		_, err := client(t, url, procRequired, p, true).CallUnary(ctx, keyed("r32-dl-"+p.name, "1"))
		require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err), "%s: the handler's own code: %v", p.name, err)
	}
}

// A request in binary protobuf carrying a field this build does not know
// (a newer client's), and the same request in JSON, which connect decodes
// discarding unknown fields: the same call.
func TestReview32UnknownFieldIsTheSameCallAcrossEncodings(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, nil)
	body, err := proto.Marshal(&testingv1.Request{Body: "u"})
	require.NoError(t, err)
	body = protowire.AppendTag(body, 99, protowire.BytesType)
	body = protowire.AppendString(body, "from a newer client")
	post := func(ct string, b []byte) (int, string) {
		req, err := http.NewRequest(http.MethodPost, url+procRequired, bytes.NewReader(b))
		require.NoError(t, err)
		req.Header.Set("Content-Type", ct)
		req.Header.Set(idempotency.HeaderKey, "r32-unknown")
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		out, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(out)
	}
	code, out := post("application/proto", body)
	require.Equal(t, http.StatusOK, code, out)
	code, out = post("application/json", []byte(`{"body":"u","unknownField":"x"}`))
	require.Equal(t, http.StatusOK, code, "the same call in JSON: %s", out)
	code, out = post("application/json", []byte(`{"amount":"0","body":"u"}`))
	require.Equal(t, http.StatusOK, code, "the same call with a default value spelled out: %s", out)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// One key sent to two procedures: the second is KEY_REUSED, not run.
func TestReview32SameKeyAnotherProcedure(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, nil)
	ctx := context.Background()
	_, err := client(t, url, procRequired, protocols[0], true).CallUnary(ctx, keyed("r32-proc", "p"))
	require.NoError(t, err)
	_, err = client(t, url, "/idempotency.testing.v1.PolicyService/Optional", protocols[1], true).CallUnary(ctx, keyed("r32-proc", "p"))
	require.Equal(t, connect.CodeFailedPrecondition, connectCode(err), "%v", err)
	require.EqualValues(t, 1, runs.Load())
}

// gzip both ways: a compressed request and response, then an uncompressed
// one with the same key, in each protocol: one call, the same message.
func TestReview32GzipBothWays(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, []connect.HandlerOption{connect.WithCompressMinBytes(0)})
	ctx := context.Background()
	var first int64
	for i, p := range protocols {
		opts := append([]connect.ClientOption{}, p.opts...)
		if i%2 == 0 {
			opts = append(opts, connect.WithSendGzip(), connect.WithCompressMinBytes(0))
		}
		c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, p.h2c), url+procRequired, opts...)
		resp, err := c.CallUnary(ctx, keyed("r32-gzip", "g"))
		require.NoError(t, err, p.name)
		if i == 0 {
			first = resp.Msg.GetLedgerId()
		}
		require.Equal(t, first, resp.Msg.GetLedgerId(), p.name)
	}
	require.EqualValues(t, 1, runs.Load())
}
