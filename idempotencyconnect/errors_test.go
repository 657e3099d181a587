package idempotencyconnect_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Every caller of a key gets the same answer: a connect handler's final
// error, whatever its shape, reaches the first caller exactly as it
// reaches every replay (code, message, details byte for byte, and the
// error's metadata), in every protocol.
func TestFinalErrorAnswersEveryCallerAlike(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	var fnErr atomic.Pointer[error]
	url := mount(t, e.store, func(context.Context, *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		return nil, *fnErr.Load()
	}, nil, nil, nil)
	ctx := context.Background()
	for i, shape := range connectFinalShapes() {
		t.Run(shape.name, func(t *testing.T) {
			for _, p := range protocols {
				key := fmt.Sprintf("final-%d-%s", i, p.name)
				c := client(t, url, procRequired, p, true)
				before := runs.Load()
				err := shape.err()
				fnErr.Store(&err)
				_, err = c.CallUnary(ctx, keyed(key, "x"))
				first := connectAnswer(t, err)
				require.Equal(t, shape.code, first.code, "%s: %v", p.name, err)
				again := errors.New("the handler ran again")
				fnErr.Store(&again)
				_, err = c.CallUnary(ctx, keyed(key, "x"))
				require.Equal(t, first, connectAnswer(t, err), "%s: the replay is the first answer", p.name)
				require.Equal(t, before+1, runs.Load(), "%s: the handler ran once", p.name)
			}
		})
	}
}

// connectFinalShape is an error a connect handler returns: marked Final,
// or with a code the server stores by default.
type connectFinalShape struct {
	name string
	err  func() error // a new one for each call: connect adds to an error's metadata
	code connect.Code
}

func connectFinalShapes() []connectFinalShape {
	declined := func() *connect.Error {
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("the card was declined"))
		d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example", Metadata: map[string]string{"card": "4242"}})
		if err != nil {
			panic(err)
		}
		ce.AddDetail(d)
		ce.Meta().Set("X-Decline-Code", "51")
		return ce
	}
	return []connectFinalShape{
		{name: "a plain error", err: func() error { return idempotency.Final(errors.New("card declined")) }, code: connect.CodeUnknown},
		{name: "a plain error wrapped with %w", err: func() error { return idempotency.Final(fmt.Errorf("charge 42: %w", errors.New("card declined"))) }, code: connect.CodeUnknown},
		{name: "a connect error", err: func() error { return connect.NewError(connect.CodeNotFound, errors.New("no such card")) }, code: connect.CodeNotFound},
		{name: "a connect error with details and metadata", err: func() error { return declined() }, code: connect.CodeFailedPrecondition},
		{name: "a connect error with details and metadata, marked Final", err: func() error { return idempotency.Final(declined()) }, code: connect.CodeFailedPrecondition},
		{name: "a connect error with details and metadata, wrapped with %w", err: func() error { return fmt.Errorf("charge 42: %w", declined()) }, code: connect.CodeFailedPrecondition},
		{name: "a gRPC status error", err: func() error { return status.Error(codes.NotFound, "no such card") }, code: connect.CodeNotFound},
		{name: "a gRPC status error wrapped with %w, marked Final", err: func() error {
			return idempotency.Final(fmt.Errorf("charge 42: %w", status.Error(codes.NotFound, "no such card")))
		}, code: connect.CodeNotFound},
		{name: "a connect error whose message is not UTF-8", err: func() error { return connect.NewError(connect.CodeNotFound, errors.New("caf\xe9 card")) }, code: connect.CodeNotFound},
		{name: "a context's error", err: func() error { return idempotency.Final(context.DeadlineExceeded) }, code: connect.CodeDeadlineExceeded},
		{name: "a context's error wrapped with %w", err: func() error { return idempotency.Final(fmt.Errorf("the bank timed out: %w", context.Canceled)) }, code: connect.CodeCanceled},
		{name: "an error whose status is nil", err: func() error { return idempotency.Final(statusError{text: "no status"}) }, code: connect.CodeUnknown},
		{name: "an error whose status says OK", err: func() error {
			return idempotency.Final(statusError{st: status.New(codes.OK, "all good"), text: "all good"})
		}, code: connect.CodeUnknown},
	}
}

// statusError is an error with a gRPC status of its own, which may be nil.
type statusError struct {
	st   *status.Status
	text string
}

func (e statusError) Error() string { return e.text }

func (e statusError) GRPCStatus() *status.Status { return e.st }

// connectErrAnswer is what a connect client sees of an error: its code,
// message, details (type and bytes) and metadata, less what a transport
// sets for itself and the replay marker.
type connectErrAnswer struct {
	code    connect.Code
	msg     string
	details []string
	meta    string
}

func connectAnswer(t *testing.T, err error) connectErrAnswer {
	t.Helper()
	var ce *connect.Error
	require.True(t, errors.As(err, &ce), "%v is a connect error", err)
	a := connectErrAnswer{code: ce.Code(), msg: ce.Message()}
	for _, d := range ce.Details() {
		a.details = append(a.details, d.Type()+":"+string(d.Bytes()))
	}
	var meta []string
	for k, vs := range ce.Meta() {
		if k = strings.ToLower(k); strings.HasPrefix(k, "x-") {
			meta = append(meta, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(meta)
	a.meta = strings.Join(meta, ";")
	return a
}

// errView is what a client sees of an error: code, message, details
// and the metadata it came with (less the replay marker).
type errView struct {
	code    connect.Code
	msg     string
	details []string
	meta    map[string]string
}

func viewOf(t *testing.T, err error) errView {
	t.Helper()
	var ce *connect.Error
	require.True(t, errors.As(err, &ce), "%v is a connect error", err)
	v := errView{code: ce.Code(), msg: ce.Message(), meta: map[string]string{}}
	for _, d := range ce.Details() {
		v.details = append(v.details, d.Type())
	}
	for k, vs := range ce.Meta() {
		k = strings.ToLower(k)
		if strings.HasPrefix(k, "x-") {
			v.meta[k] = strings.Join(vs, ",")
		}
	}
	sort.Strings(v.details)
	return v
}

// A final error with a detail and metadata: every caller of the key, in
// every protocol, sees the code, message, details and metadata the first
// caller saw.
func TestFinalErrorIsReplayedAsSent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, key string
		fail      func(ctx context.Context, t *testing.T) error
	}{
		// The handler sets headers and trailers through CallInfo, then fails
		// with a final error wrapping a connect error (fmt.Errorf("%w")).
		{"wrapped, with CallInfo headers and trailers", "r32-wrapped-", func(ctx context.Context, t *testing.T) error {
			info, ok := connect.CallInfoForHandlerContext(ctx)
			require.True(t, ok)
			info.ResponseHeader().Set("X-Info-Header", "h")
			info.ResponseTrailer().Set("X-Info-Trailer", "t")
			ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("the card was declined"))
			d, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
			ce.AddDetail(d)
			ce.Meta().Set("X-Decline-Code", "51")
			return fmt.Errorf("charge: %w", ce)
		}},
		// The message is not valid UTF-8 (a byte of a legacy encoding).
		{"message not valid UTF-8", "r32-utf8-", func(context.Context, *testing.T) error {
			ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("card holder M\xfcller declined"))
			d, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
			ce.AddDetail(d)
			ce.Meta().Set("X-Decline-Code", "51")
			return ce
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var runs atomic.Int64
			fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
				runs.Add(1)
				return nil, tc.fail(ctx, t)
			}
			url := mount(t, e.store, fn, nil, nil, nil)
			ctx := context.Background()
			for _, p := range protocols {
				key := tc.key + p.name
				c := client(t, url, procRequired, p, true)
				_, err := c.CallUnary(ctx, keyed(key, "d"))
				first := viewOf(t, err)
				require.Equal(t, connect.CodeFailedPrecondition, first.code, p.name)
				_, err = c.CallUnary(ctx, keyed(key, "d"))
				require.Equal(t, first, viewOf(t, err), "%s: the replay is the first answer", p.name)
				require.Equal(t, "51", first.meta["x-decline-code"], "%s: the error's metadata", p.name)
				require.Equal(t, []string{"google.rpc.ErrorInfo"}, first.details, "%s: the error's detail", p.name)
			}
			require.EqualValues(t, len(protocols), runs.Load())
		})
	}
}

// A handler's own error that is a context error of its own making (a
// sub-operation's deadline, while the call's context is alive): connect
// sends it as DeadlineExceeded, and so does grpc-go; with the
// idempotency interceptor the code must stay.
func TestHandlersOwnDeadlineErrorKeepsItsCode(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		sub, cancel := context.WithTimeout(ctx, time.Nanosecond)
		defer cancel()
		<-sub.Done()
		return nil, sub.Err()
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	plainMux := http.NewServeMux()
	plainMux.Handle(procRequired, connect.NewUnaryHandler(procRequired, fn))
	plainURL := serve(t, plainMux)
	ctx := context.Background()
	_, err := client(t, plainURL, procRequired, protocols[0], true).CallUnary(ctx, keyed("r32-dl", "1"))
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err), "connect without the interceptor: %v", err)

	// grpc-go with UnaryServerInterceptor keeps it too.
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, serializableWork{work: func(ctx context.Context, _ *testingv1.Request) (*testingv1.Response, error) {
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
