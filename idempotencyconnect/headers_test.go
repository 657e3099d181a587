package idempotencyconnect_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// binarySig is a binary header value: not valid text, as a signature is.
var binarySig = string([]byte{0x00, 0x01, 0xfe, 0xff, 'a'})

// binHeaderService is the test service on grpc-go: it writes a ledger row and
// sets a binary header (-bin), which grpc-go sends base64-encoded and its
// clients decode.
type binHeaderService struct {
	testingv1.UnimplementedPolicyServiceServer
	runs *atomic.Int64
}

func (s binHeaderService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	s.runs.Add(1)
	if err := grpc.SetHeader(ctx, metadata.Pairs("x-sig-bin", binarySig)); err != nil {
		return nil, err
	}
	return ledger(ctx, req)
}

// binHeaderServers is a grpc-go server with UnaryServerInterceptor and a connect
// handler, on one store; the connect handler sets the same binary header
// as connect-go sends one (connect.EncodeBinaryHeader).
func binHeaderServers(t *testing.T) (e *env, grpcURL, connectURL string, runs *atomic.Int64) {
	e = newEnv(t)
	runs = new(atomic.Int64)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, binHeaderService{runs: runs})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	connectURL = mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Sig-Bin", connect.EncodeBinaryHeader([]byte(binarySig)))
		return r, nil
	}, nil, nil, nil)
	return e, "http://" + lis.Addr().String(), connectURL, runs
}

// A grpc-go client's call of one key, first to one server, then to the
// other (a replica of another framework, on the same store): the replay
// carries the binary header the first answer carried, byte for byte, in
// either order.
func TestBinaryHeaderReplayedAcrossFrameworks(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, key, body string
		connectFirst    bool
	}{
		{"grpc-go server first, connect handler replays", "r32-bin-1", "1", false},
		{"connect handler first, grpc-go server replays", "r32-bin-2", "2", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, grpcURL, connectURL, runs := binHeaderServers(t)
			firstURL, replayURL := grpcURL, connectURL
			if tc.connectFirst {
				firstURL, replayURL = connectURL, grpcURL
			}
			ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, tc.key)
			var h1, h2, tr metadata.MD
			first, err := grpcClient(t, firstURL).Required(ctx, &testingv1.Request{Body: tc.body}, grpc.Header(&h1))
			require.NoError(t, err)
			require.Equal(t, []string{binarySig}, h1.Get("x-sig-bin"), "the first answer's binary header")

			again, err := grpcClient(t, replayURL).Required(ctx, &testingv1.Request{Body: tc.body}, grpc.Header(&h2), grpc.Trailer(&tr))
			require.NoError(t, err)
			require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
			require.Equal(t, []string{"true"}, tr.Get(idempotency.ReplayedTrailer), "a replay")
			require.Equal(t, []string{binarySig}, h2.Get("x-sig-bin"), "the replay's binary header is the first answer's")
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, 1, e.ledgerRows())
		})
	}
}

// Within connect alone: a binary header set by the handler is replayed
// byte for byte to a connect client in each protocol.
func TestBinaryHeaderReplayedByteForByteWithinConnect(t *testing.T) {
	t.Parallel()
	_, _, connectURL, runs := binHeaderServers(t)
	ctx := context.Background()
	first, err := client(t, connectURL, procRequired, protocols[1], true).CallUnary(ctx, keyed("r32-bin-3", "3"))
	require.NoError(t, err)
	raw, err := connect.DecodeBinaryHeader(first.Header().Get("X-Sig-Bin"))
	require.NoError(t, err)
	require.Equal(t, binarySig, string(raw))
	for _, p := range protocols {
		resp, err := client(t, connectURL, procRequired, p, true).CallUnary(ctx, keyed("r32-bin-3", "3"))
		require.NoError(t, err, p.name)
		require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), p.name)
		raw, err := connect.DecodeBinaryHeader(resp.Header().Get("X-Sig-Bin"))
		require.NoError(t, err, p.name)
		require.Equal(t, binarySig, string(raw), p.name)
	}
	require.EqualValues(t, 1, runs.Load())
}

// An interceptor outside the idempotency interceptor sets a response
// header through CallInfo (a default: a cache header, Vary, a CORS
// header); the handler then changes it. The first answer carries the
// header as the handler left it; the replay must carry the same.
func TestHandlerChangingAnOuterHeaderIsReplayedAsFirstSent(t *testing.T) {
	t.Parallel()
	type header struct {
		name   string
		values []string // nil: the answer has none
	}
	for _, tc := range []struct {
		name, key  string
		outer      [2]string // the header the outer interceptor sets, and its value
		handle     func(ctx context.Context, r *connect.Response[testingv1.Response])
		protocols  []protocol
		firstSends []header // the first answer's headers, which the replay must repeat
	}{
		// The handler replaces the default (Set) through CallInfo.
		{
			name: "the handler's Set replaces it", key: "r32-replace-",
			outer: [2]string{"Cache-Control", "no-store"},
			handle: func(ctx context.Context, _ *connect.Response[testingv1.Response]) {
				info, _ := connect.CallInfoForHandlerContext(ctx)
				info.ResponseHeader().Set("Cache-Control", "private, max-age=60")
			},
			protocols:  protocols[:1],
			firstSends: []header{{"Cache-Control", []string{"private, max-age=60"}}},
		},
		// The handler adds a value of the same header on its
		// connect.Response: connect merges the two, the first answer
		// carries both values.
		{
			name: "a value on the handler's Response is merged with it", key: "r32b-merge-",
			outer: [2]string{"X-Vary", "origin"},
			handle: func(_ context.Context, r *connect.Response[testingv1.Response]) {
				r.Header().Set("X-Vary", "authorization")
			},
			protocols:  protocols,
			firstSends: []header{{"X-Vary", []string{"origin", "authorization"}}},
		},
		// The handler deletes it (the answer must not carry it: a cache
		// header on a charge) and sets another.
		{
			name: "the handler's Del removes it", key: "r32b-del-",
			outer: [2]string{"X-Cacheable", "yes"},
			handle: func(ctx context.Context, _ *connect.Response[testingv1.Response]) {
				info, _ := connect.CallInfoForHandlerContext(ctx)
				info.ResponseHeader().Del("X-Cacheable")
				info.ResponseHeader().Set("X-Charged", "1")
			},
			protocols:  protocols[1:2],
			firstSends: []header{{"X-Cacheable", nil}, {"X-Charged", []string{"1"}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var runs atomic.Int64
			outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
				return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
					info, _ := connect.CallInfoForHandlerContext(ctx)
					info.ResponseHeader().Set(tc.outer[0], tc.outer[1])
					return next(ctx, req)
				}
			})
			fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
				runs.Add(1)
				resp, err := ledger(ctx, req.Msg)
				if err != nil {
					return nil, err
				}
				r := connect.NewResponse(resp)
				tc.handle(ctx, r)
				return r, nil
			}
			url := mount(t, e.store, fn, []connect.Interceptor{outer}, nil, nil)
			for _, p := range tc.protocols {
				c := client(t, url, procRequired, p, true)
				key := tc.key + p.name
				first, err := c.CallUnary(context.Background(), keyed(key, "h"))
				require.NoError(t, err)
				for _, h := range tc.firstSends {
					if h.values == nil {
						require.Empty(t, first.Header().Values(h.name), "%s: the first answer's %s", p.name, h.name)
					} else {
						require.Equal(t, h.values, first.Header().Values(h.name), "%s: the first answer's %s", p.name, h.name)
					}
				}
				again, err := c.CallUnary(context.Background(), keyed(key, "h"))
				require.NoError(t, err)
				require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
				for _, h := range tc.firstSends {
					require.Equal(t, first.Header().Values(h.name), again.Header().Values(h.name),
						"%s: the replay carries the %s the first answer carried", p.name, h.name)
				}
			}
			require.EqualValues(t, len(tc.protocols), runs.Load())
		})
	}
}

// appMD is a metadata's application keys (x-...), sorted, as k=v.
func appMD(md metadata.MD) []string {
	var out []string
	for k, vs := range md {
		if strings.HasPrefix(k, "x-") {
			out = append(out, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(out)
	return out
}

// A connect handler sets a header and a trailer through CallInfo and fails
// with a final error carrying metadata; a grpc-go client calls it twice
// with one key. gRPC tells headers from trailers: the replay puts each
// where the first answer had it.
func TestFinalErrorHeadersAndTrailersKeepTheirPlaceForGRPCClients(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Info-Header", "h")
		info.ResponseTrailer().Set("X-Info-Trailer", "t")
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place")
	gc := grpcClient(t, url)
	var h1, t1, h2, t2 metadata.MD
	_, err := gc.Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = gc.Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, appMD(h1), appMD(h2), "headers: first %v, replay %v (trailers: first %v, replay %v)", appMD(h1), appMD(h2), appMD(t1), appMD(t2))
	require.Equal(t, appMD(t1), appMD(t2), "trailers: first %v, replay %v", appMD(t1), appMD(t2))
	require.EqualValues(t, 1, runs.Load())
}

// The same across frameworks: a grpc-go handler sets a header and fails
// with a final error; the replay through the connect handler puts the
// header where the grpc-go server put it.
func TestFinalErrorHeaderFromGRPCServerKeepsItsPlaceOnConnect(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, serializableWork{work: func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		runs.Add(1)
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-info-header", "h"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-info-trailer", "t"))
		return nil, status.Error(codes.FailedPrecondition, "declined")
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	connectURL := mount(t, e.store, func(context.Context, *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		t.Error("the connect handler ran")
		return nil, errors.New("must not run")
	}, nil, nil, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place-2")
	var h1, t1, h2, t2 metadata.MD
	_, err := grpcClient(t, "http://"+lis.Addr().String()).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = grpcClient(t, connectURL).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, appMD(h1), appMD(h2), "headers: first %v, replay %v (trailers: first %v, replay %v)", appMD(h1), appMD(h2), appMD(t1), appMD(t2))
	require.Equal(t, appMD(t1), appMD(t2), "trailers: first %v, replay %v", appMD(t1), appMD(t2))
	require.EqualValues(t, 1, runs.Load())
}

// A connect handler's final error with metadata (connect's gRPC protocol
// sends an error's metadata as trailers), then its replay through a
// grpc-go server with UnaryServerInterceptor on the same store: a grpc-go
// client finds the metadata where the first answer had it.
func TestFinalErrorMetaFromConnectKeepsItsPlaceOnGRPCServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, serializableWork{work: func(context.Context, *testingv1.Request) (*testingv1.Response, error) {
		t.Error("the grpc-go handler ran")
		return nil, errors.New("must not run")
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place-3")
	var h1, t1, h2, t2 metadata.MD
	_, err := grpcClient(t, url).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = grpcClient(t, "http://"+lis.Addr().String()).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, appMD(t1), appMD(t2), "trailers: first %v, replay %v (headers: first %v, replay %v)", appMD(t1), appMD(t2), appMD(h1), appMD(h2))
	require.Equal(t, appMD(h1), appMD(h2), "headers: first %v, replay %v", appMD(h1), appMD(h2))
	require.EqualValues(t, 1, runs.Load())
}

// Runs of the handler whose answer the engine replaces with its own error
// (the handler ended the call's transaction; the handler's database
// session died under it): the headers the run set, through CallInfo and on
// its response, are not sent with that error, nor with its replay.
func TestEngineErrorsCarryNoHeadersOfTheRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Leak-Info", "1")
		info.ResponseTrailer().Set("X-Leak-Trailer", "1")
		tx := idempotency.MustTxFromContext(ctx)
		switch req.Msg.GetBody() {
		case "commit":
			_, _ = tx.Exec(ctx, "COMMIT")
		case "die":
			_, _ = tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
		}
		r := connect.NewResponse(&testingv1.Response{Body: "ok"})
		r.Header().Set("X-Leak-Resp", "1")
		return r, nil
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	for _, body := range []string{"commit", "die"} {
		for _, p := range protocols {
			c := client(t, url, procRequired, p, true)
			for i := range 2 {
				_, err := c.CallUnary(context.Background(), keyed("r32-leak-"+body+p.name, body))
				require.Error(t, err, "%s %s %d", body, p.name, i)
				v := viewOf(t, err)
				for k := range v.meta {
					require.False(t, strings.HasPrefix(k, "x-leak"), "%s %s %d: %s sent with %v", body, p.name, i, k, err)
				}
			}
		}
	}
}

// rawConnectCall posts a Connect-protocol JSON request of procedure with key, as
// curl or a browser would, and returns the status and the application
// headers of the answer (x-... and trailer-x-..., lower case, sorted, as
// name=values), the replay marker left out.
func rawConnectCall(t *testing.T, url, procedure, key, body string) (int, []string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+procedure, bytes.NewBufferString(`{"body":"`+body+`"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Connect-Protocol-Version", "1")
	req.Header.Set(idempotency.HeaderKey, key)
	resp, err := httpClient(t, false).Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	var out []string
	for k, vs := range resp.Header {
		k = strings.ToLower(k)
		if strings.HasPrefix(k, "x-") || strings.HasPrefix(k, "trailer-x-") {
			out = append(out, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(out)
	return resp.StatusCode, out
}

// A final error with metadata, answered in the Connect protocol: connect
// sends an error's metadata as plain response headers. A caller reading
// the answer as HTTP (curl, a browser, a proxy) must find the metadata in
// the same place on the replay.
func TestFinalErrorMetaKeepsItsPlaceInTheConnectProtocol(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}, nil, nil, nil)
	st1, h1 := rawConnectCall(t, url, procRequired, "r32b-raw-meta", "x")
	st2, h2 := rawConnectCall(t, url, procRequired, "r32b-raw-meta", "x")
	require.Equal(t, st1, st2)
	require.Equal(t, []string{"x-decline-code=51"}, h1, "the first answer")
	require.Equal(t, h1, h2, "the replay's headers")
	require.EqualValues(t, 1, runs.Load())
}

// An interceptor outside the idempotency interceptor strips internal
// headers from the response before it leaves the service (resp.Header(),
// and an error's Meta()). The first answer carries none; a replay of the
// key goes out through the same interceptor and must carry none either.
func TestOuterInterceptorStrippingResponseHeadersStripsTheReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	strip := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			if err != nil {
				var ce *connect.Error
				if errors.As(err, &ce) {
					ce.Meta().Del("X-Internal-Shard")
				}
				return nil, err
			}
			resp.Header().Del("X-Internal-Shard")
			return resp, nil
		}
	})
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		if req.Msg.GetBody() == "fail" {
			ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
			ce.Meta().Set("X-Internal-Shard", "7")
			return nil, ce
		}
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Internal-Shard", "7")
		return r, nil
	}
	url := mount(t, e.store, fn, []connect.Interceptor{strip}, nil, nil)
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		key := "r32b-strip-" + p.name
		first, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		require.Empty(t, first.Header().Values("X-Internal-Shard"), "%s: the first answer", p.name)
		again, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
		assert.Empty(t, again.Header().Values("X-Internal-Shard"), "%s: the replay", p.name)

		_, err1 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		_, err2 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		assert.NotContains(t, viewOf(t, err1).meta, "x-internal-shard", "%s: the first error", p.name)
		assert.NotContains(t, viewOf(t, err2).meta, "x-internal-shard", "%s: the replayed error", p.name)
	}
	require.EqualValues(t, 2*len(protocols), runs.Load())
}

// A handler that sets the replay marker itself (a copy of a downstream
// answer's headers, or a malicious handler) and fails transiently: the
// attempt was not a replay, so the marker must not reach the client, as
// grpc-go's recorder refuses it (SetTrailer fails, nothing is sent).
func TestHandlersOwnReplayMarkerOnATransientErrorIsNotSent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		ce := connect.NewError(connect.CodeUnavailable, errors.New("busy"))
		switch req.Msg.GetBody() {
		case "info":
			info, _ := connect.CallInfoForHandlerContext(ctx)
			info.ResponseTrailer().Set(idempotency.ReplayedTrailer, "true")
		case "meta":
			ce.Meta().Set(idempotency.ReplayedTrailer, "true")
		}
		return nil, ce
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	for _, body := range []string{"info", "meta"} {
		for _, p := range protocols {
			_, err := client(t, url, procRequired, p, true).CallUnary(context.Background(), keyed("r32b-marker-"+body+p.name, body))
			var ce *connect.Error
			require.True(t, errors.As(err, &ce), "%v", err)
			assert.Equal(t, connect.CodeUnavailable, ce.Code(), "%s %s", body, p.name)
			assert.Empty(t, ce.Meta().Values(idempotency.ReplayedTrailer), "%s %s: an executed attempt marked replayed", body, p.name)
		}
	}
}

// A handler sets a -bin header whose value is not base64 (a mistake the
// client may or may not notice): the replay sends what the first answer
// sent, not another value.
func TestBinaryHeaderThatIsNotBase64IsReplayedAsSent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Trace-Bin", "v=1;not*base64")
		return r, nil
	}, nil, nil, nil)
	st1, h1 := rawConnectCall(t, url, procRequired, "r32b-notb64", "b")
	st2, h2 := rawConnectCall(t, url, procRequired, "r32b-notb64", "b")
	require.Equal(t, http.StatusOK, st1)
	require.Equal(t, st1, st2)
	require.Equal(t, []string{"x-trace-bin=v=1;not*base64"}, h1)
	require.Equal(t, h1, h2, "the replay")
	require.EqualValues(t, 1, runs.Load())
}

// A handler that sets more than MaxStoredMetadata of headers on a keyed
// call: the call fails (nothing can be stored for a replay), its writes
// roll back, its oversized headers are not sent, and the answer is the
// same for a retry.
func TestHeadersBeyondMaxStoredMetadataFailTheCallAndRollBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	big := strings.Repeat("x", idempotency.MaxStoredMetadata+1)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Big-Info", big)
		r := connect.NewResponse(resp)
		r.Header().Set("X-Small", "s")
		return r, nil
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	ctx := context.Background()
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		for range 2 {
			_, err := c.CallUnary(ctx, keyed("r32-big-"+p.name, "b"))
			require.Equal(t, connect.CodeInternal, connectCode(err), "%s: %v", p.name, err)
			require.ErrorContains(t, err, "MaxStoredMetadata", p.name)
			var ce *connect.Error
			require.True(t, errors.As(err, &ce))
			require.Empty(t, ce.Meta().Get("X-Big-Info"), p.name)
			require.Empty(t, ce.Meta().Get("X-Small"), p.name)
		}
	}
	require.Equal(t, 0, e.ledgerRows())
}

// 20 calls of distinct keys at once, through connect's four protocols and
// grpc-go (to a grpc-go server on the same store), on a database whose
// sessions default to SERIALIZABLE with a short statement and lock
// timeout, each a read-modify-write of one balance row: the database
// aborts most runs, the layer answers Aborted with RetryInfo, the clients
// retry. Every key applies once (the balance is 20), and every answer and
// its replay carry the headers of the run that committed (the run's number
// is in the ledger row it wrote), never those of an aborted run.
func TestSerializableContentionAnswersWithTheCommittedRunsHeaders(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		c.ConnConfig.RuntimeParams["statement_timeout"] = "2s"
		c.ConnConfig.RuntimeParams["lock_timeout"] = "1s"
		c.MaxConns = 8
	})
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL);
		CREATE TABLE balance (id int PRIMARY KEY, v int NOT NULL); INSERT INTO balance VALUES (1, 0)`)
	require.NoError(t, err)
	var runs atomic.Int64
	// work is one run: its number goes in the ledger row and in the
	// headers and trailers it sets.
	work := func(ctx context.Context, req *testingv1.Request, set func(h, tr string)) (*testingv1.Response, error) {
		n := runs.Add(1)
		set(fmt.Sprint(n), fmt.Sprint(n))
		tx := idempotency.MustTxFromContext(ctx)
		var v int
		if err := tx.QueryRow(ctx, `SELECT v FROM balance WHERE id = 1`).Scan(&v); err != nil {
			return nil, err
		}
		time.Sleep(5 * time.Millisecond) // widen the window between the read and the write
		if _, err := tx.Exec(ctx, `UPDATE balance SET v = $1 WHERE id = 1`, v+1); err != nil {
			return nil, err
		}
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, fmt.Sprint(n)).Scan(&id); err != nil {
			return nil, err
		}
		return &testingv1.Response{Body: fmt.Sprint(n), LedgerId: id}, nil
	}
	url := mount(t, store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		var hdr string
		resp, err := work(ctx, req.Msg, func(h, tr string) {
			info.ResponseHeader().Set("X-Run", h)
			info.ResponseTrailer().Set("X-Run-Trailer", tr)
			hdr = h
		})
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Run-Resp", hdr)
		return r, nil
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, serializableWork{work: func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		return work(ctx, req, func(h, tr string) {
			_ = grpc.SetHeader(ctx, metadata.Pairs("x-run", h, "x-run-resp", h))
			_ = grpc.SetTrailer(ctx, metadata.Pairs("x-run-trailer", tr))
		})
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	copts := []idempotency.ClientOption{idempotency.WithRetryBackoff(2*time.Millisecond, 20*time.Millisecond)}
	gc := grpcClient(t, "http://"+lis.Addr().String(), idempotency.UnaryClientInterceptor(copts...))

	// answer is what a caller saw: the body and the three run numbers.
	type answer struct{ body, hdr, resp, trailer string }
	call := func(i int, key string) (answer, error) {
		kctx := idempotency.WithOutgoingKey(ctx, key)
		if i%5 == 4 {
			var h, tr metadata.MD
			resp, err := gc.Required(kctx, &testingv1.Request{Body: "c"}, grpc.Header(&h), grpc.Trailer(&tr))
			if err != nil {
				return answer{}, err
			}
			first := func(md metadata.MD, k string) string {
				if v := md.Get(k); len(v) > 0 {
					return v[0]
				}
				return ""
			}
			return answer{resp.GetBody(), first(h, "x-run"), first(h, "x-run-resp"), first(tr, "x-run-trailer")}, nil
		}
		resp, err := client(t, url, procRequired, protocols[i%len(protocols)], false, copts...).CallUnary(kctx, connect.NewRequest(&testingv1.Request{Body: "c"}))
		if err != nil {
			return answer{}, err
		}
		return answer{resp.Msg.GetBody(), resp.Header().Get("X-Run"), resp.Header().Get("X-Run-Resp"), resp.Trailer().Get("X-Run-Trailer")}, nil
	}
	const n = 20
	answers := make([]answer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i], errs[i] = call(i, "r32b-ser-"+strconv.Itoa(i)) })
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		a := answers[i]
		require.Equal(t, answer{a.body, a.body, a.body, a.body}, a, "caller %d: the headers of the run that committed", i)
		again, err := call(i, "r32b-ser-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, a, again, "caller %d: the replay", i)
		// The same key through the other framework.
		elsewhere := 4 // grpc-go
		if i%5 == 4 {
			elsewhere = i + 1 // connect
		}
		other, err := call(elsewhere, "r32b-ser-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, a, other, "caller %d: the replay elsewhere", i)
	}
	require.Equal(t, n, db.Count(t, `SELECT v FROM balance`))
	require.Equal(t, n, db.Count(t, `SELECT count(*) FROM ledger`))
	t.Logf("%d runs for %d calls", runs.Load(), n)
}
