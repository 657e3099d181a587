package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// chargeClient is one way a handler charges a provider: start runs the
// provider and returns its address, send (one new request to the
// provider at addr, reporting whether the connection was refused), and
// what reached the provider and what it charged.
type chargeClient struct {
	name  string
	start func(t *testing.T) (addr string, send func(ctx context.Context, addr string) (refused bool, err error), arrived, charged func() int64)
}

// chargeClients are the clients of this package that send a key: an
// http.Client over HTTPTransport, HTTPClient, and the gRPC client chain.
var chargeClients = []chargeClient{
	{"HTTPTransport", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		return httpCharges(t, (&http.Client{Transport: &idempotency.HTTPTransport{}}).Do)
	}},
	{"HTTPClient", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		return httpCharges(t, (&idempotency.HTTPClient{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond}).Do)
	}},
	{"UnaryClientInterceptor", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		inner := newEnv(t, envConfig{})
		chain := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(2), idempotency.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
		conns := map[string]*grpc.ClientConn{}
		send := func(ctx context.Context, addr string) (bool, error) {
			if conns[addr] == nil {
				conns[addr] = dialKeyed(t, addr, chain)
			}
			err := conns[addr].Invoke(ctx, methodCharge, wrapperspb.String("charge order-14"), &wrapperspb.StringValue{})
			return status.Code(err) == codes.Unavailable && strings.Contains(status.Convert(err).Message(), "connection refused"), err
		}
		return inner.addr, send, inner.arrived.Load, inner.execs.Load
	}},
}

// httpCharges is a provider behind HTTPMiddleware, charged through do.
func httpCharges(t *testing.T, do func(*http.Request) (*http.Response, error)) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
	p := startProvider(t)
	send := func(ctx context.Context, addr string) (bool, error) {
		resp, err := do(newPost(t, ctx, "http://"+addr+"/v1/charges", "charge order-14"))
		if err != nil {
			return errors.Is(err, syscall.ECONNREFUSED), err
		}
		if body := readAll(resp); resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("provider: %s %q", resp.Status, body)
		}
		return false, nil
	}
	arrived := func() int64 { return int64(len(p.headers.all())) }
	return strings.TrimPrefix(p.url, "http://"), send, arrived, p.execs.Load
}

// A handler charges a provider it knows at two addresses. On its first run
// the first address refuses the connection (nothing was sent), so the
// handler sends a new request to the second, which charges; then the run
// fails, releasing its key. The re-run starts with the address that
// answered. Unnamed, the charge gets no key inside the call: it is
// refused, nothing sent, with an error saying how to name it (a counted
// key gave the handler's second request the next ordinal, and the
// re-run's first request the first: two charges). Named, it keeps one key
// across the handler's own retry and the re-run: one charge.
func TestHandlerRetryingAnEffectWithANewRequest(t *testing.T) {
	t.Parallel()
	for _, c := range chargeClients {
		for _, named := range []bool{false, true} {
			name := c.name + "/unnamed"
			if named {
				name = c.name + "/named"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				addr, send, arrived, charged := c.start(t)
				refused := closedAddr(t)
				store := migratedStore(t, testdb.New(t, 2))
				call := idempotency.Call{Scope: "shop", Key: "order-14", Method: "Checkout"}

				answered := "" // the address that answered last: the handler tries it first
				var runs int
				run := func() error {
					_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
						runs++
						if named {
							ctx = idempotency.WithEffect(ctx, "charge order-14")
						}
						addrs := []string{refused, addr}
						if answered != "" {
							addrs = []string{answered, refused}
						}
						for _, a := range addrs {
							wasRefused, err := send(ctx, a)
							if wasRefused {
								continue // the next address, with a new request
							}
							if err != nil {
								return nil, err
							}
							answered = a
							if runs == 1 {
								return nil, status.Error(codes.Unavailable, "fail after the provider charged, releasing the key")
							}
							return wrapperspb.String("charged"), nil
						}
						return nil, status.Error(codes.Unavailable, "no address answered")
					})
					return err
				}
				first, second := run(), run()

				if !named {
					require.Zero(t, charged(), "the provider charged nothing")
					require.Zero(t, arrived(), "nothing was sent")
					for _, err := range []error{first, second} {
						require.ErrorIs(t, err, idempotency.ErrUnnamedEffect)
						require.Equal(t, codes.Internal, status.Code(err), "a configuration error: %v", err)
						require.Contains(t, err.Error(), "WithEffect", "the error says how to name the effect")
					}
					return
				}
				require.Equal(t, codes.Unavailable, status.Code(first), "the first run fails after the provider charged: %v", first)
				require.NoError(t, second)
				require.EqualValues(t, 2, arrived(), "each run's charge reached the provider once")
				require.EqualValues(t, 1, charged(), "the provider charged once: the re-run sent the first run's key")
			})
		}
	}
}

// catalogDesc serves idempotency.test.Catalog (see harness_test.go: Get is
// NO_SIDE_EFFECTS, Put IDEMPOTENT, Buy unmarked), echoing the request.
func catalogDesc() *grpc.ServiceDesc {
	method := func(name string) grpc.MethodDesc {
		return grpc.MethodDesc{MethodName: name, Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &wrapperspb.StringValue{}
			if err := dec(req); err != nil {
				return nil, err
			}
			info := &grpc.UnaryServerInfo{FullMethod: "/idempotency.test.Catalog/" + name}
			return icpt(ctx, req, info, func(_ context.Context, req any) (any, error) { return req, nil })
		}}
	}
	return &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Catalog",
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{method("Get"), method("Put"), method("Buy")},
	}
}

// Inside a running call, every outgoing call that needs a key and has
// neither a key nor a name is refused, nothing sent, whatever the client
// and however it is sent again; calls that need no key (GET, PUT, DELETE;
// a method protobuf marks NO_SIDE_EFFECTS or IDEMPOTENT) are sent without
// one, and a named call with its effect's key.
func TestOutgoingCallsInsideACallNeedANameOrAKey(t *testing.T) {
	t.Parallel()
	var httpKeys keyLog
	httpSrv := h2cServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpKeys.add(r.Header.Get(idempotency.HeaderKey))
	}), 0)
	var grpcKeys keyLog
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		return grpcKeys.intercept(ctx, req, nil, h)
	}))
	srv.RegisterService(catalogDesc(), nil)
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(_ context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) { return req, nil }})
	addr := serve(t, srv)
	conn := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))
	noUnknownKeys := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1), idempotency.WithKeysForUnknownMethods(false)))
	store := migratedStore(t, testdb.New(t, 2))

	transport := (&http.Client{Transport: &idempotency.HTTPTransport{}}).Do
	resent := (&http.Client{Transport: &resending{base: &idempotency.HTTPTransport{}, max: 3}}).Do
	client := fastRetries(nil).Do
	httpCall := func(do func(*http.Request) (*http.Response, error), method string) func(context.Context) error {
		return func(ctx context.Context) error {
			req, err := http.NewRequestWithContext(ctx, method, httpSrv.URL+"/v1/items", strings.NewReader("x"))
			require.NoError(t, err)
			resp, err := do(req)
			if err == nil {
				_ = readAll(resp)
			}
			return err
		}
	}
	grpcCall := func(conn *grpc.ClientConn, method string) func(context.Context) error {
		return func(ctx context.Context) error {
			return conn.Invoke(ctx, method, wrapperspb.String("x"), &wrapperspb.StringValue{})
		}
	}
	const (
		refused = "refused"
		noKey   = "sent without a key"
		named   = "sent with the effect's key"
	)
	for _, c := range []struct {
		name  string
		send  func(context.Context) error
		named bool
		want  string
		hint  string // in the refusal's message, beside WithEffect
	}{
		{"HTTPTransport POST", httpCall(transport, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPTransport PATCH", httpCall(transport, http.MethodPatch), false, refused, "HTTPClient"},
		{"HTTPTransport POST resent by a transport above", httpCall(resent, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPClient POST", httpCall(client, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPClient PATCH", httpCall(client, http.MethodPatch), false, refused, "HTTPClient"},
		{"HTTPTransport GET", httpCall(transport, http.MethodGet), false, noKey, ""},
		{"HTTPTransport PUT", httpCall(transport, http.MethodPut), false, noKey, ""},
		{"HTTPClient DELETE", httpCall(client, http.MethodDelete), false, noKey, ""},
		{"HTTPTransport POST named", httpCall(transport, http.MethodPost), true, named, ""},
		{"HTTPClient POST named", httpCall(client, http.MethodPost), true, named, ""},
		{"gRPC unmarked method", grpcCall(conn, "/idempotency.test.Catalog/Buy"), false, refused, "NO_SIDE_EFFECTS"},
		{"gRPC method not linked in", grpcCall(conn, methodCharge), false, refused, "WithKeysForUnknownMethods"},
		{"gRPC NO_SIDE_EFFECTS method", grpcCall(conn, "/idempotency.test.Catalog/Get"), false, noKey, ""},
		{"gRPC IDEMPOTENT method", grpcCall(conn, "/idempotency.test.Catalog/Put"), false, noKey, ""},
		{"gRPC method not linked in, WithKeysForUnknownMethods(false)", grpcCall(noUnknownKeys, methodCharge), false, noKey, ""},
		{"gRPC unmarked method named", grpcCall(conn, "/idempotency.test.Catalog/Buy"), true, named, ""},
	} {
		httpBefore, grpcBefore := len(httpKeys.all()), len(grpcKeys.all())
		var effect string
		_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-15", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			if c.named {
				effect, _ = idempotency.EffectKey(ctx, "charge")
				ctx = idempotency.WithEffect(ctx, "charge")
			}
			if err := c.send(ctx); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.Unavailable, "release the key, for the next case")
		})
		arrived := append(httpKeys.all()[httpBefore:], grpcKeys.all()[grpcBefore:]...)
		switch c.want {
		case refused:
			require.ErrorIs(t, err, idempotency.ErrUnnamedEffect, c.name)
			require.Equal(t, codes.Internal, status.Code(err), c.name)
			require.ErrorContains(t, err, "WithEffect", c.name)
			require.ErrorContains(t, err, c.hint, c.name)
			require.Empty(t, arrived, "%s: nothing was sent", c.name)
		case noKey:
			require.Equal(t, codes.Unavailable, status.Code(err), "%s: %v", c.name, err)
			require.Equal(t, []string{""}, arrived, "%s: sent once, without a key", c.name)
		case named:
			require.Equal(t, codes.Unavailable, status.Code(err), "%s: %v", c.name, err)
			requireDerived(t, []string{effect}, "order-15")
			require.Equal(t, []string{effect}, arrived, "%s: sent once, with the effect's key", c.name)
		}
	}
}
