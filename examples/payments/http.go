package payments

import (
	"encoding/json"
	"io"
	"net/http"

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
// ({"account_id": "acct-1", "amount_cents": 100}). POST /v1/charges needs an
// Idempotency-Key header; GET needs none.
func NewHTTPHandler(svc *Server, store *idempotency.Store, opts ...idempotency.HTTPOption) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idempotency.HTTPMiddleware(store, opts...)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
	return mux
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
	}
	return http.StatusInternalServerError
}
