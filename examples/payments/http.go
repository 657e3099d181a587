package payments

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
)

// NewHTTPHandler serves the PaymentService as JSON over HTTP, on the same
// business code (and the same store) as the gRPC service:
//
//	POST /v1/charges                        ChargeRequest  -> ChargeResponse
//	GET  /v1/accounts/{account_id}/balance                 -> GetBalanceResponse
//
// Bodies are the protobuf JSON forms with the proto field names
// ({"account_id": "acct-1", "amount_cents": 100}). Every request needs an
// "Authorization: Bearer <token>" header naming one of callers' tokens;
// POST /v1/charges also needs an Idempotency-Key header, which is the
// caller's own: the same key from another caller is another call.
func NewHTTPHandler(svc *Server, store *idempotency.Store, callers Callers, opts ...idempotency.HTTPOption) http.Handler {
	// Each caller's keys are their own: the scope is who is calling, as
	// the authentication in front of the mux found it (not the token,
	// which may change between a call and its retry).
	scope := idempotency.WithHTTPScope(func(r *http.Request) (string, error) {
		return CallerFromContext(r.Context())
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idempotency.HTTPMiddleware(store, append([]idempotency.HTTPOption{scope}, opts...)...)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req := &paymentsv1.ChargeRequest{}
		if !readJSON(w, r, req) {
			return
		}
		resp, err := svc.Charge(r.Context(), req)
		writeJSON(w, resp, err)
	})))
	mux.HandleFunc("GET /v1/accounts/{account_id}/balance", func(w http.ResponseWriter, r *http.Request) {
		resp, err := svc.GetBalance(r.Context(), &paymentsv1.GetBalanceRequest{AccountId: r.PathValue("account_id")})
		writeJSON(w, resp, err)
	})
	return callers.authenticate(mux)
}

// Callers maps each bearer token the HTTP API accepts to the caller it
// authenticates. A real service asks its identity provider instead; what
// matters here is that the idempotency scope is the caller it returns.
type Callers map[string]string

// DemoCallers are the callers the example server accepts by default, for
// the README's curl session: alice and bob.
func DemoCallers() Callers {
	return Callers{"demo-token-alice": "alice", "demo-token-bob": "bob"}
}

// ParseCallers reads callers as "token=caller" pairs separated by commas.
func ParseCallers(s string) (Callers, error) {
	c := Callers{}
	for _, pair := range strings.Split(s, ",") {
		token, caller, ok := strings.Cut(strings.TrimSpace(pair), "=")
		if !ok || token == "" || caller == "" {
			return nil, fmt.Errorf("callers: %q is not a token=caller pair", pair)
		}
		if _, dup := c[token]; dup {
			return nil, fmt.Errorf("callers: a token is listed twice")
		}
		c[token] = caller
	}
	return c, nil
}

type callerKey struct{}

// CallerFromContext returns the caller the HTTP API authenticated, or an
// Unauthenticated error.
func CallerFromContext(ctx context.Context) (string, error) {
	if c, ok := ctx.Value(callerKey{}).(string); ok {
		return c, nil
	}
	return "", status.Error(codes.Unauthenticated, "no authenticated caller")
}

// authenticate answers 401 to a request without one of the callers'
// tokens, and puts the caller in the context of the others.
func (c Callers) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		ok = ok && strings.EqualFold(scheme, "Bearer") // the scheme is case-insensitive (RFC 9110)
		caller, known := c[strings.TrimSpace(token)]
		if !ok || !known {
			w.Header().Set("WWW-Authenticate", "Bearer")
			writeJSON(w, nil, status.Error(codes.Unauthenticated, "send Authorization: Bearer <token> with a token of a known caller"))
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, caller)))
	})
}

// readJSON decodes the request body into m, or answers 400.
func readJSON(w http.ResponseWriter, r *http.Request, m proto.Message) bool {
	b, err := io.ReadAll(r.Body)
	if err == nil {
		err = protojson.Unmarshal(b, m)
	}
	if err != nil {
		writeJSON(w, nil, status.Errorf(codes.InvalidArgument, "request body: %v", err))
		return false
	}
	return true
}

// writeJSON answers with m in JSON, or with err as problem+json and the
// HTTP status of its gRPC code.
func writeJSON(w http.ResponseWriter, m proto.Message, err error) {
	if err != nil {
		st := status.Convert(err)
		code := httpStatus(st.Code())
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(map[string]any{"type": "about:blank", "title": http.StatusText(code), "status": code, "detail": st.Message()})
		return
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

func httpStatus(c codes.Code) int {
	switch c {
	case codes.InvalidArgument, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.NotFound:
		return http.StatusNotFound
	case codes.FailedPrecondition:
		return http.StatusPreconditionFailed
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	}
	return http.StatusInternalServerError
}
